"""Run 42: attention over a selection, where its time goes and two changes that did not pay.

`kernels.decode_attention` is two launches: a split-K chunk kernel (a program per chunk of a KV
head's selection) and a log-sum-exp merge (a program per query head). Over a tenth of the pages it
reads 1.7 TB/s at 128K and 0.9 TB/s at 32K, against 2.9 TB/s for dense attention at 128K.

Call 1 (``python attn_variants.py [rows.json]``): the chunk kernel's loop waited for three dependent
memory round trips a tile (entries, keys, then values after the softmax). `variant.py`'s chunk
kernel reads them as ``LOADS`` says: ``"after"`` (the library's order), ``"with"`` (values beside
keys) or ``"ahead"`` (the next tile's reads before this tile's sums). Each against the library's
op (``default``), and the default's launches timed apart: the chunk kernel alone, the merge alone,
both over an empty selection. ``--best rows.json`` prints each ``LOADS`` value's fastest setting as
`benchmarks.ab` variants (kept here as the call ran them; `AttentionConfig` has no ``loads`` since).

Call 2 (``python attn_variants.py --merge``): the merge with the head dim split over programs
(`variant._merge_split_kernel`) against the library's, alone and after the chunk kernel.

``--streams``: the chunk kernel as independent softmax streams (`AttentionConfig.streams`, opt-in at
75df9c8, removed since: run it in that tree) against the default. Run 43 ran it on an H200
(``../2026-12-07-h200-run43``): slower in every setting.

Timed as in run 40's `locality.py`: CUDA graphs over three copies of the layer, median of
`do_bench`. From the repository root on a CUDA machine (``PYTHONPATH=$PWD``); on a CPU the calls
run once in Triton's interpreter (a dry run).
"""
import dataclasses
import json
import math
import pathlib
import sys

import torch
import triton

from benchmarks.probes import D, H_KV, PAGE, _dense_layer
from policyzoo import kernels
from policyzoo.kernels import AttentionConfig
from policyzoo.kernels.config import override
from policyzoo.kernels.ops.decode_attention import _choose
from policyzoo.kernels.ops.decode_attention import kernel as K
from policyzoo.selection import Selection

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import variant as V  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [("tenth", 131072), ("tenth", 32768), ("dense", 4096), ("dense", 32768), ("dense", 131072)]


def graph_us(calls) -> tuple[float, torch.Tensor]:
    """µs of one ``calls()`` replayed in a CUDA graph (nan on a CPU), and its last output."""
    out = calls()
    if dev == "cpu":
        return float("nan"), out
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = calls()
    graph.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=300, return_mode="median") * 1e3, out


def launch(cfg, q, keys, values, sel, start, length, parts="both", loads=None, block_d=0, merge_warps=None):
    """`kernel._softmax` with the library's chunk kernel (``loads=None``) or `variant`'s, and the
    library's merge (``block_d=0``) or the split one; ``parts``: "both", "chunk" or "merge"."""
    b, h, d = q.shape
    k_max = sel.indices.shape[-1]
    n_chunks = max(1, triton.cdiv(k_max, cfg.chunk))
    o_part = torch.zeros(b, h, n_chunks, d, dtype=torch.float32, device=q.device)
    m_part = torch.zeros(b, h, n_chunks, dtype=torch.float32, device=q.device)
    l_part = torch.ones(b, h, n_chunks, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, dtype=torch.float32, device=q.device)
    interp = dev == "cpu"
    chunk_kernel, extra = (K._softmax_chunk_kernel, {}) if loads is None else (V._softmax_chunk_kernel, {"LOADS": loads})

    def run():
        if parts in ("both", "chunk"):
            chunk_kernel[(n_chunks, keys.shape[1], b)](
                q, keys, values, sel.indices, sel.indices, sel.count, sel.indices, start, length.reshape(()),
                m_part, l_part, o_part,
                *K._strides(q, 2), *K._strides(keys, 3), *K._strides(values, 3), *K._strides(sel.indices, 3),
                *K._strides(sel.indices, 3), *K._strides(sel.count, 2), *K._strides(sel.indices, 3),
                keys.shape[2], k_max, cfg.chunk, n_chunks, D**-0.5,
                G=h // keys.shape[1], G_PAD=16, D=d, D_PAD=d, BLOCK=sel.block, BLOCK_T=cfg.block_t, HAS_LW=False,
                HAS_SLOTS=False, UPCAST=interp, PRECISION="ieee" if interp else "tf32",
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra)
        if parts in ("both", "merge"):
            if block_d:
                V._merge_split_kernel[(h, b, d // block_d)](
                    m_part, l_part, o_part, out, lse, out.stride(0), out.stride(1), n_chunks,
                    D=d, BLOCK_D=block_d, BLOCK_C=max(16, triton.next_power_of_2(n_chunks)), num_warps=merge_warps)
            else:
                K._merge_kernel[(h, b)](m_part, l_part, o_part, out, lse, out.stride(0), out.stride(1), n_chunks,
                                        D=d, D_PAD=d, BLOCK_C=cfg.block_c, num_warps=cfg.merge_warps)
        return out
    return run


def case_inputs(kind: str, n: int, g):
    """Three copies of a layer at context ``n`` and the selection: every page, or a random tenth."""
    layers = [_dense_layer(n) for _ in range(3)]
    pages = n // PAGE
    if kind == "tenth":
        k = math.ceil(pages / 10)
        idx = torch.stack([torch.randperm(pages, device=dev, generator=g)[:k].sort().values for _ in range(H_KV)]).int()
        sel = Selection(idx[None].contiguous(), torch.full((1, H_KV), k, device=dev, dtype=torch.int32), block=PAGE)
    else:
        k, sel = pages, layers[0][5]
    return layers, sel, k, 2 * H_KV * k * PAGE * D * 2 / 1e6


def timed(layers, runs) -> tuple[float, torch.Tensor]:
    """µs a layer of ``runs`` (one per copy), and the last copy's output."""
    us, out = graph_us(lambda: [r() for r in runs][-1])
    return us / len(layers), out


def loads_variants(out_json: str | None = None):
    """Call 1: the chunk kernel's read schedules."""
    rows = []
    variants = [("default", None, {})]
    for bt in (32, 64):
        for w in (4, 8):
            for loads, stages in (("after", 2), ("with", 1), ("with", 2), ("ahead", 1)):
                variants.append((f"{loads} st{stages} bt{bt} w{w}", loads, dict(block_t=bt, num_warps=w, num_stages=stages)))
    variants += [(f"{name} p1024", loads, {**c, "target_programs": 1024}) for name, loads, c in variants[1:] if loads != "after"]
    cases = CASES
    if dev == "cpu":
        cases, variants = [("tenth", 1024), ("dense", 512)], variants[:1] + [v for v in variants if v[1] == "ahead"][:1]
    g = torch.Generator(device=dev).manual_seed(3)
    base = AttentionConfig()
    for kind, n in cases:
        layers, sel, k, mb = case_inputs(kind, n, g)
        print(f"\n{kind} {n}: {k} pages a KV head, {mb:.1f} MB a layer", flush=True)
        want = kernels.decode_attention(*layers[-1][:3], sel, *layers[-1][3:5], D**-0.5)[0].float()
        for name, loads, change in variants:
            cfg = _choose(dataclasses.replace(base, **change), k, PAGE, H_KV, D)
            try:
                if loads is None:
                    with override(attention=base):
                        us, out = graph_us(lambda: [kernels.decode_attention(*l[:3], sel, *l[3:5], D**-0.5)[0] for l in layers][-1])
                    us /= len(layers)
                    empty = Selection(sel.indices, torch.zeros_like(sel.count), block=PAGE)
                    parts = {part: timed(layers, [launch(cfg, *l[:3], s, *l[3:5], parts=part) for l in layers])[0]
                             for part, s in (("chunk", sel), ("merge", sel), ("both", empty))}
                    print(f"  default split: chunk {cfg.chunk} pages x {triton.cdiv(k, cfg.chunk)} chunks, tile {cfg.block_t}; "
                          f"chunk kernel alone {parts['chunk']:.1f} µs, merge alone {parts['merge']:.1f} µs, "
                          f"both over an empty selection {parts['both']:.1f} µs", flush=True)
                else:
                    us, out = timed(layers, [launch(cfg, *l[:3], sel, *l[3:5], loads=loads) for l in layers])
                ok = torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2)
                print(f"  {name:<28} {us:7.1f} µs  {mb / us:5.2f} TB/s{'' if ok else '  DIFFERS'}", flush=True)
                rows.append(dict(case=kind, context=n, variant=name, change={**change, **({"loads": loads} if loads else {})},
                                 us=us, MB=mb, same=ok))
            except Exception as e:  # noqa: BLE001
                print(f"  {name:<28} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del layers
        if dev == "cuda":
            torch.cuda.empty_cache()
        if out_json:
            pathlib.Path(out_json).write_text(json.dumps(rows, indent=1))


def merge_variants():
    """Call 2: the merge with the head dim split over programs, alone and after the chunk kernel."""
    variants = [("library merge", 0, None)] + [(f"split d{bd} w{w}", bd, w) for bd in (16, 32, 64) for w in (1, 2, 4)]
    cases = CASES[:3] if dev == "cuda" else [("tenth", 1024)]
    if dev == "cpu":
        variants = variants[:2]
    g = torch.Generator(device=dev).manual_seed(3)
    for kind, n in cases:
        layers, sel, k, mb = case_inputs(kind, n, g)
        cfg = _choose(AttentionConfig(), k, PAGE, H_KV, D)
        print(f"\n{kind} {n}: {k} pages a KV head, {mb:.1f} MB a layer, {triton.cdiv(k, cfg.chunk)} chunks", flush=True)
        want = None
        for name, bd, w in variants:
            alone = timed(layers, [launch(cfg, *l[:3], sel, *l[3:5], parts="merge", block_d=bd, merge_warps=w) for l in layers])[0]
            us, out = timed(layers, [launch(cfg, *l[:3], sel, *l[3:5], block_d=bd, merge_warps=w) for l in layers])
            want = out.float().clone() if want is None else want
            same = torch.allclose(out.float(), want, rtol=1e-3, atol=1e-3)
            print(f"  {name:<18} merge alone {alone:5.1f} µs   with the chunk kernel {us:6.1f} µs{'' if same else '  DIFFERS'}", flush=True)
        del layers


def streams_variants():
    """The chunk kernel as independent softmax streams (`AttentionConfig.streams`, in the tree of
    75df9c8 only), against the default, through the library's op."""
    variants = [(f"streams {w} x {bt} tokens, {warps} warps, {st} stages", w, bt, warps, st)
                for w, bt, warps, st in ((4, 16, 4, 2), (4, 16, 4, 1), (2, 16, 2, 2), (4, 32, 4, 2), (8, 16, 8, 2))]
    cases = CASES if dev == "cuda" else [("tenth", 1024)]
    if dev == "cpu":
        variants = variants[:1]
    g = torch.Generator(device=dev).manual_seed(3)
    for kind, n in cases:
        layers, sel, k, mb = case_inputs(kind, n, g)
        def op():
            return [kernels.decode_attention(*l[:3], sel, *l[3:5], D**-0.5)[0] for l in layers][-1]

        want = op().float()
        us = graph_us(op)[0] / len(layers)
        print(f"\n{kind} {n}: {mb:.1f} MB a layer; default {us:.1f} µs ({mb / us:.2f} TB/s)", flush=True)
        for name, w, bt, warps, st in variants:
            cfg = AttentionConfig(streams=w, block_t=bt, num_warps=warps, num_stages=st)
            try:
                with override(attention=cfg):
                    us, out = graph_us(op)
                us /= len(layers)
                same = torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2)
                print(f"  {name:<36} {us:7.1f} µs  {mb / us:5.2f} TB/s{'' if same else '  DIFFERS'}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  {name:<36} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del layers


def best(rows, loads: str) -> dict:
    """The fastest change of one ``loads`` value: lowest geometric mean over the cases, against the default."""
    cases = {(r["case"], r["context"]) for r in rows}
    default = {(r["case"], r["context"]): r["us"] for r in rows if r["variant"] == "default"}
    scores = {}
    for r in rows:
        if r["change"].get("loads") == loads and r["same"]:
            scores.setdefault(r["variant"], []).append(math.log(r["us"] / default[(r["case"], r["context"])]))
    name = min((v for v in scores if len(scores[v]) == len(cases)), key=lambda v: sum(scores[v]))
    return next(r["change"] for r in rows if r["variant"] == name)


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}  torch {torch.__version__}  "
          f"triton {triton.__version__}", flush=True)
    if len(sys.argv) > 2 and sys.argv[1] == "--best":
        rows = json.loads(pathlib.Path(sys.argv[2]).read_text())
        print(" ".join(f"--variant {loads}=" + ",".join(f"attention.{k}={v}" for k, v in best(rows, loads).items())
                       for loads in ("with", "ahead")))
    elif len(sys.argv) > 1 and sys.argv[1] == "--merge":
        merge_variants()
    elif len(sys.argv) > 1 and sys.argv[1] == "--streams":
        streams_variants()
    else:
        loads_variants(sys.argv[1] if len(sys.argv) > 1 else None)
