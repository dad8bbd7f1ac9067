"""Run 42: where attention over a selection spends its fixed ~13 µs, and whether issuing the value
loads with the key loads (and the next tile's loads before this tile's sums) removes it.

`kernels.decode_attention`'s chunk kernel loads a tile's values only after the tile's logits and
softmax (the compiled loop is: index load, keys, dot, exp, values, dot), so a program with a few
tiles waits for three dependent memory round trips per tile. `AttentionConfig.loads` now says when
a tile's reads are issued: ``"after"`` (as before), ``"with"`` (the values beside the keys) or
``"ahead"`` (the next tile's index, key and value loads before this tile's sums). Timed as in run 40's `locality.py`:
CUDA graphs over three copies of the layer, median of `do_bench`. From the repository root on a
CUDA machine:

    PYTHONPATH=$PWD python benchmarks/results/2026-12-07-run42/attn_variants.py [rows.json]
    PYTHONPATH=$PWD python benchmarks/results/2026-12-07-run42/attn_variants.py --best rows.json  # ab's variants
"""
import dataclasses
import json
import math
import pathlib
import sys

import torch
import triton

from benchmarks.probes import D, H, H_KV, PAGE, _dense_layer
from policyzoo import kernels
from policyzoo.kernels import AttentionConfig
from policyzoo.kernels.config import override
from policyzoo.kernels.ops.decode_attention import _choose
from policyzoo.kernels.ops.decode_attention import kernel as K
from policyzoo.selection import Selection

dev = "cuda" if torch.cuda.is_available() else "cpu"


def graph_us(calls) -> tuple[float, torch.Tensor]:
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


def launch(kernel, cfg, q, keys, values, sel, start, length, parts="both"):
    """`kernel._softmax` with a chosen chunk kernel; ``parts``: "both", "chunk" or "merge"."""
    b, h, d = q.shape
    k_max = sel.indices.shape[-1]
    n_chunks = max(1, triton.cdiv(k_max, cfg.chunk))
    o_part = torch.empty(b, h, n_chunks, d, dtype=torch.float32, device=q.device)
    m_part = torch.zeros(b, h, n_chunks, dtype=torch.float32, device=q.device)
    l_part = torch.ones(b, h, n_chunks, dtype=torch.float32, device=q.device)
    o_part.zero_()
    out = torch.empty_like(q)
    lse = torch.empty(b, h, dtype=torch.float32, device=q.device)
    interp = dev == "cpu"

    def run():
        if parts in ("both", "chunk"):
            kernel[(n_chunks, keys.shape[1], b)](
                q, keys, values, sel.indices, sel.indices, sel.count, sel.indices, start, length.reshape(()),
                m_part, l_part, o_part,
                *K._strides(q, 2), *K._strides(keys, 3), *K._strides(values, 3), *K._strides(sel.indices, 3),
                *K._strides(sel.indices, 3), *K._strides(sel.count, 2), *K._strides(sel.indices, 3),
                keys.shape[2], k_max, cfg.chunk, n_chunks, D**-0.5,
                G=h // keys.shape[1], G_PAD=16, D=d, D_PAD=d, BLOCK=sel.block, BLOCK_T=cfg.block_t, HAS_LW=False,
                HAS_SLOTS=False, UPCAST=interp, PRECISION="ieee" if interp else "tf32", LOADS=cfg.loads,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if parts in ("both", "merge"):
            K._merge_kernel[(h, b)](m_part, l_part, o_part, out, lse, out.stride(0), out.stride(1), n_chunks,
                                    D=d, D_PAD=d, BLOCK_C=cfg.block_c, num_warps=cfg.merge_warps)
        return out
    return run


def main(out_json: str | None = None):
    rows = []
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}  torch {torch.__version__}  "
          f"triton {triton.__version__}", flush=True)
    g = torch.Generator(device=dev).manual_seed(3)
    cases = [("tenth", 131072), ("tenth", 32768), ("dense", 4096), ("dense", 32768), ("dense", 131072)]
    if dev == "cpu":
        cases = [("tenth", 1024), ("dense", 512)]
    variants = [("default", {})]
    for bt in (32, 64):
        for w in (4, 8):
            for loads, stages in (("after", 2), ("with", 1), ("with", 2), ("ahead", 1)):
                variants.append((f"{loads} st{stages} bt{bt} w{w}", dict(block_t=bt, num_warps=w, num_stages=stages, loads=loads)))
    variants += [(f"{name} p1024", {**c, "target_programs": 1024}) for name, c in variants[1:] if c["loads"] != "after"]
    if dev == "cpu":
        variants = variants[:1] + [v for v in variants if v[1].get("loads") == "ahead"][:1]
    for kind, n in cases:
        layers = [_dense_layer(n) for _ in range(3)]
        pages = n // PAGE
        if kind == "tenth":
            k = math.ceil(pages / 10)
            idx = torch.stack([torch.randperm(pages, device=dev, generator=g)[:k].sort().values for _ in range(H_KV)]).int()
            sel = Selection(idx[None].contiguous(), torch.full((1, H_KV), k, device=dev, dtype=torch.int32), block=PAGE)
        else:
            k, sel = pages, layers[0][5]
        mb = 2 * H_KV * k * PAGE * D * 2 / 1e6
        print(f"\n{kind} {n}: {k} pages a KV head, {mb:.1f} MB a layer", flush=True)
        want = kernels.decode_attention(*layers[-1][:3], sel, *layers[-1][3:5], D**-0.5)[0].float()  # graph_us returns the last copy's
        base = AttentionConfig()
        for name, change in variants:
            cfg = dataclasses.replace(base, **change)
            try:
                with override(attention=cfg):
                    us, out = graph_us(lambda: [kernels.decode_attention(*l[:3], sel, *l[3:5], D**-0.5)[0] for l in layers][-1])
                if not change:  # the default kernel's two launches apart, and with an empty selection
                    cfg = _choose(base, k, PAGE, H_KV)
                    parts = {}
                    for part, s in (("chunk", sel), ("merge", sel), ("both", Selection(sel.indices, torch.zeros_like(sel.count), block=PAGE))):
                        runs = [launch(K._softmax_chunk_kernel, cfg, *l[:3], s, *l[3:5], parts=part) for l in layers]
                        parts[part] = graph_us(lambda: [r() for r in runs][-1])[0] / 3
                    print(f"  default split: chunk {cfg.chunk} pages x {triton.cdiv(k, cfg.chunk)} chunks, tile {cfg.block_t}; "
                          f"chunk kernel alone {parts['chunk']:.1f} µs, merge alone {parts['merge']:.1f} µs, "
                          f"both over an empty selection {parts['both']:.1f} µs", flush=True)
                ok = torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2)
                print(f"  {name:<28} {us / 3:7.1f} µs  {mb / (us / 3):5.2f} TB/s{'' if ok else '  DIFFERS'}", flush=True)
                rows.append(dict(case=kind, context=n, variant=name, change=change, us=us / 3, MB=mb, same=ok))
            except Exception as e:  # noqa: BLE001
                print(f"  {name:<28} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del layers
        if dev == "cuda":
            torch.cuda.empty_cache()
        if out_json:
            pathlib.Path(out_json).write_text(json.dumps(rows, indent=1))


def best(rows, loads: str) -> dict:
    """The fastest change of one ``loads`` value: lowest geometric mean over the cases, against the default."""
    cases = {(r["case"], r["context"]) for r in rows}
    default = {(r["case"], r["context"]): r["us"] for r in rows if not r["change"]}
    scores = {}
    for r in rows:
        if r["change"].get("loads") == loads and r["same"]:
            scores.setdefault(r["variant"], []).append(math.log(r["us"] / default[(r["case"], r["context"])]))
    name = min((v for v in scores if len(scores[v]) == len(cases)), key=lambda v: sum(scores[v]))
    return next(r["change"] for r in rows if r["variant"] == name)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--best":  # the ab variants for a rows file: NAME=attention.f=v,...
        rows = json.loads(pathlib.Path(sys.argv[2]).read_text())
        print(" ".join(f"--variant {loads}=" + ",".join(f"attention.{k}={v}" for k, v in best(rows, loads).items())
                       for loads in ("with", "ahead")))
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else None)
