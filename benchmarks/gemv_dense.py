"""Dense GEMV probe: cuBLAS against `kernels.dense_gemv` / `kernels.dense_gemv_t` over a grid of
`DenseGemvConfig` overrides, on the Llama-3.1-8B decode projections (bf16, batch 1 and 4).

Run on a CUDA machine::

    python -m benchmarks.gemv_dense                                  # every shape, batch 1 and 4
    python -m benchmarks.gemv_dense --shapes o,down --batches 1 --out benchmarks/results/RUN/gemv-dense.json

Each shape is timed in the layout it is stored: q|k|v and gate|up input-major (``w_t [d_in, d_out]``
contiguous: cuBLAS ``x @ w_t``, the op `dense_gemv_t`), o, down and the LM head output-major
(nn.Linear's ``weight [d_out, d_in]``: cuBLAS ``F.linear``, the op `dense_gemv`). Every timing is
`common.graph_time_ms` (20 calls in one CUDA graph), rotating over copies of the weight that
together take three times the 50 MB L2 (two at least), so that every call reads its weight from HBM.
Per row: the shape, the setting, µs, TB/s of the weight's bytes and the speedup over cuBLAS; every
config is first checked against cuBLAS (its relative error is recorded; above 2e-2 it is not timed).
Then the fastest config per shape and batch.

The grid (`grid`): tiles, warps, stages and split from the module's choices, at most `MAX_CONFIGS`
per layout and batch kind (a seeded sample), the same sample for every shape of a layout so that
compiled kernels are reused; then around the best of each shape the split-K epilogue launched, other
program targets, and at batch > 1 one program per row. ``--deadline`` (seconds) stops starting
configs, keeping what ran.

Without a GPU, ``--tiny`` runs it as a smoke test at toy sizes with two configs per shape (the
kernels in the Triton interpreter when ``TRITON_INTERPRET=1 POLICYZOO_TRITON=1`` are set; wall-clock
timings that mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from policyzoo import kernels
from policyzoo.kernels import DenseGemvConfig
from policyzoo.kernels.config import override

from . import common

# label -> (d_in, d_out, input-major): how each Llama-3.1-8B projection (its fused groups) is stored.
SHAPES = {
    "q|k|v": (4096, 6144, True),
    "gate|up": (4096, 28672, True),
    "o": (4096, 4096, False),
    "down": (14336, 4096, False),
    "lm_head": (4096, 128256, False),
}
BATCHES = (1, 4)
MAX_CONFIGS = 48  # per layout and batch kind; with the refinements about 55 per shape
MAX_ERR = 2e-2
# Tiles of each layout: output-major tiles run along the inputs (block_k wide), input-major ones
# along the outputs (block_n wide).
TILES = {False: dict(block_n=(8, 16, 32, 64), block_k=(128, 256, 512)),
         True: dict(block_n=(64, 128, 256), block_k=(16, 32, 64, 128))}
WARPS, STAGES, SPLITS = (2, 4, 8), (2, 3, 4), (0, 1, 2, 4)
SMEM_BYTES = 200 << 10  # an H200's shared memory per block, less some: tl.dot stages beyond it fail


def _fits(c: dict, batch: int) -> bool:
    """Whether a config is worth timing: at one row, 8 to 128 fp32 accumulators per thread (the
    ``block_n x block_k`` products over the warps' threads); in row blocks (tl.dot), tiles of 16 at
    least whose pipelined bf16 operands fit in shared memory."""
    if batch == 1:
        return 8 <= c["block_n"] * c["block_k"] // (32 * c["num_warps"]) <= 128
    return (c["block_n"] >= 16 and c["block_k"] >= 16
            and c["num_stages"] * (16 + c["block_n"]) * c["block_k"] * 2 <= SMEM_BYTES)


def grid(input_major: bool, batch: int, limit: int = MAX_CONFIGS, seed: int = 0) -> list[dict]:
    """`DenseGemvConfig` fields to try on a layout at ``batch`` rows: the product of `TILES`, `WARPS`,
    `STAGES` and `SPLITS` that `_fits`, a seeded sample of ``limit`` where there are more."""
    tiles = TILES[input_major]
    every = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s, split=sp)
             for bn, bk, w, s, sp in itertools.product(tiles["block_n"], tiles["block_k"], WARPS, STAGES, SPLITS)]
    every = [c for c in every if _fits(c, batch)]
    if len(every) > limit:
        every = random.Random(seed * 1000 + (batch > 1) * 2 + input_major).sample(every, limit)
    return sorted(every, key=lambda c: tuple(c.values()))


def refinements(best: dict, batch: int) -> list[dict]:
    """Around the best config of a shape: the split-K epilogue launched rather than fused, other
    program targets for a split from the shapes, and at several rows one program per row (no tl.dot)."""
    return ([dict(best, fuse_epilogue=False)] + [dict(best, split=0, target_programs=tp) for tp in (256, 1024, 2048)]
            + ([dict(best, dot_from_rows=batch + 1)] if batch > 1 else []))


def name_of(c: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in c.items()) or "default"


def bench_shape(label: str, d_in: int, d_out: int, input_major: bool, batch: int, configs: list[dict],
                rows: list[dict], deadline: float, tune_more: bool) -> None:
    dev = common.DEVICE
    workspace = kernels.Workspace(dev)  # the arrival counters, as a Decoder makes them
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    wbytes = d_in * d_out * torch.tensor([], dtype=dtype).element_size()
    copies = common.weight_copies(wbytes)
    shape = (d_in, d_out) if input_major else (d_out, d_in)  # each layout stored contiguously
    ws = [(torch.randn(*shape, device=dev, generator=g) * 0.02).to(dtype) for _ in range(copies)]
    x = torch.randn(batch, d_in, device=dev, generator=g).to(dtype)
    if input_major:
        cublas = lambda w: x @ w  # noqa: E731
        op = lambda w: kernels.dense_gemv_t(x, w, workspace=workspace)  # noqa: E731
    else:
        cublas = lambda w: F.linear(x, w)  # noqa: E731
        op = lambda w: kernels.dense_gemv(x, w, workspace=workspace)  # noqa: E731
    want = cublas(ws[0]).float()
    cublas_us = common.graph_time_ms(common.rotating([lambda w=w: cublas(w) for w in ws])) * 1e3
    base = {"shape": label, "d_in": d_in, "d_out": d_out, "input_major": input_major, "batch": batch,
            "weight_MB": wbytes / 1e6, "copies": copies, "cublas_us": cublas_us,
            "cublas_TB/s": wbytes / (cublas_us * 1e-6) / 1e12}
    rows.append(dict(base, setting="cublas", config=None, us=cublas_us, **{"TB/s": base["cublas_TB/s"]}, vs_cublas=1.0))
    print(f"{label:<8} B={batch} {'cuBLAS':<62} {cublas_us:8.1f} us {base['cublas_TB/s']:5.2f} TB/s", flush=True)
    first = len(rows)

    def run(c: dict) -> None:
        row = dict(base, setting=name_of(c), config=c)
        with common.recorded(row, f"gemv_dense {label} B={batch} {row['setting']}"):
            with override(dense_gemv=DenseGemvConfig(**c)):
                got, ms = common.call_and_time_ms(lambda: op(ws[0]), timed=common.rotating([lambda w=w: op(w) for w in ws]))
                err = ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()
                row["rel_err"] = err
                if not err <= MAX_ERR:
                    raise ValueError(f"rel err {err:.1e} against cuBLAS")
                us = ms * 1e3
            row.update({"us": us, "TB/s": wbytes / (us * 1e-6) / 1e12, "vs_cublas": cublas_us / us})
            print(f"{label:<8} B={batch} {row['setting']:<62} {us:8.1f} us {row['TB/s']:5.2f} TB/s "
                  f"x{row['vs_cublas']:4.2f} err {err:.1e}", flush=True)
        rows.append(row)

    for c in [{}, *configs]:
        if time.perf_counter() > deadline:
            raise common.Deadline
        run(c)
    timed = [r for r in rows[first:] if "us" in r]
    if tune_more and timed:
        for c in refinements(min(timed, key=lambda r: r["us"])["config"], batch):
            if time.perf_counter() > deadline:
                raise common.Deadline
            run(c)
    common.free_memory()


def best_rows(rows: list[dict]) -> list[dict]:
    """The fastest correct Triton row per shape and batch."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["setting"] != "cublas" and "us" in r:
            key = (r["shape"], r["batch"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    return list(best.values())


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--max-configs", type=int, default=MAX_CONFIGS, help="grid configs per layout and batch kind")
    p.add_argument("--deadline", type=float, default=900.0, help="seconds after which no config is started")
    p.add_argument("--tiny", action="store_true", help="toy sizes and two configs per shape (a CPU smoke test)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    names = [n for n in args.shapes.split(",") if n]
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    batches = [int(b) for b in args.batches.split(",") if b]
    deadline = time.perf_counter() + args.deadline
    rows: list[dict] = []
    meta = {"device": torch.cuda.get_device_name() if common.DEVICE == "cuda" else "cpu", "torch": torch.__version__,
            "source": common.source_digest(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "tiny": args.tiny,
            "defaults": dataclasses.asdict(DenseGemvConfig())}
    try:
        for b in batches:
            for name in names:
                d_in, d_out, input_major = SHAPES[name]
                configs = grid(input_major, b, args.max_configs)
                if args.tiny:  # toy sizes that no tile divides, the first configs of the grid
                    d_in, d_out, configs = d_in // 64 + 3, d_out // 64 + 5, configs[:2]
                bench_shape(name, d_in, d_out, input_major, b, configs, rows, deadline, tune_more=not args.tiny)
    except common.Deadline:
        print(f"deadline reached after {len(rows)} rows", flush=True)
    best = best_rows(rows)
    print("\nfastest config per shape:")
    for r in best:
        print(f"{r['shape']:<8} B={r['batch']} {r['us']:8.1f} us {r['TB/s']:5.2f} TB/s x{r['vs_cublas']:4.2f} of cuBLAS "
              f"({r['cublas_TB/s']:.2f} TB/s): {r['setting']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "best": best}, indent=1))
    return rows


if __name__ == "__main__":
    main()
