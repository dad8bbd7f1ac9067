"""Compile time of the decode step, one policy per process (issue 15).

`Decoder.compile()` traces the whole decode step (every layer, the KV policy's `select` inside the
attention function) into one graph; the first `generate` compiles it. This module times that first
call in a process of its own, against a cold Inductor cache, and splits it into its phases:

    python -m benchmarks.compile_time --policy ssa0.05+0.05 --context 32768 --json row.json
    python -m benchmarks.compile_time --policy quest0.1 --tiny --layers 32 --context 256   # CPU

``compile_s`` is the first `generate` call less a second, identical one (the prefill and the steps
cost the same both times; the second replays what the first compiled, warmed up and captured).
``dynamo_s``, ``aot_s`` and ``inductor_s`` split Dynamo's own compile time
(`torch._dynamo.utils.compile_times`): tracing the Python code, AOTAutograd (functionalisation,
decompositions, partitioning) and Inductor (lowering, scheduling, code generation and compiling the
generated kernels; ``backend_compile_s`` is AOT + Inductor). ``fx_calls`` counts the calls Dynamo
captured (FX nodes of the traced graphs), ``graphs`` the graphs compiled, ``kernels`` the kernels
Inductor generated and ``ir_nodes`` its IR nodes before fusion.

`run_isolated` runs it in a fresh subprocess with a fresh ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` (a cold cache: nothing is reused from an earlier run) under a timeout; the
sweep's ``compile`` section calls it once per policy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def policies() -> dict[str, tuple[Callable | None, Callable | None]]:
    """Compile-time policy name -> (KV policy factory, projection factory): every built-in KV
    policy (`policyzoo.spec.KV_POLICIES`), `Certified`, and a projection sparsifier, with the
    benchmark settings' parameters (`common.settings`) where they have one."""
    from policyzoo import SSA, AttentionTopK, Certified, EntmaxKV, Quest, TopK, Window

    from .common import PAGE

    return {
        "dense": (None, None),
        "window": (lambda: Window(4, 1024), None),
        "attn-topk0.1": (lambda: AttentionTopK(0.1, window=64), None),
        "quest0.1": (lambda: Quest(0.1, page=PAGE, window=64), None),
        "ssa0.05+0.05": (lambda: SSA(0.05, 0.05, page=PAGE, window=64), None),
        "ssa0.05+0.05-exact": (lambda: SSA(0.05, 0.05, proxy="exact", window=64), None),
        "entmax-kv0.1": (lambda: EntmaxKV(0.1, page=PAGE, window=64), None),
        "certified-quest0.1": (lambda: Certified(Quest(0.1, page=PAGE, window=64)), None),
        "topk0.5": (None, lambda: TopK(0.5)),
    }


# ------------------------------------------------------------------------------ in the child
def _phases() -> dict[str, float]:
    """Seconds per compile phase from Dynamo's timers (names differ a little across torch versions;
    a phase whose timer is missing is left out)."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    def total(*names: str) -> float | None:
        found = [sum(metrics[n]) for n in names if n in metrics]
        return max(found) if found else None

    out = {}
    whole = total("_compile.compile_inner", "compile_inner")
    backend = total("OutputGraph.call_user_compiler", "call_user_compiler", "_call_user_compiler")
    inductor = total("compile_fx_inner", "compile_fx.<locals>.fw_compiler_base", "fw_compiler_base")
    if whole is not None:
        out["dynamo_compile_s"] = whole
        if backend is not None:
            out["dynamo_s"] = whole - backend
    if backend is not None:
        out["backend_compile_s"] = backend
        out["aot_s"] = backend - (inductor or 0.0)  # aot_eager: the whole backend is AOTAutograd
    if inductor is not None:
        out["inductor_s"] = inductor
    for key, names in (("lowering_s", ("GraphLowering.run",)), ("codegen_s", ("GraphLowering.codegen", "GraphLowering.compile_to_module")),
                       ("scheduler_s", ("Scheduler.__init__",)), ("kernel_compile_s", ("async_compile.wait", "AsyncCompile.wait"))):
        value = total(*names)
        if value is not None:
            out[key] = value
    return out


def measure(name: str, *, shape: str, context: int, new_tokens: int, layers: int | None, tiny: bool, backend: str,
            regional: bool | None = None, step_ms: bool = True) -> dict:
    """One row (see the module docstring); the caller's process must be fresh."""
    import torch
    from torch._dynamo.utils import counters

    from policyzoo import Decoder
    from policyzoo.timing import time_step

    from . import common, e2e

    kv_f, proj_f = policies()[name]
    model = common.random_model(shape, layers, tiny)
    dec = Decoder(model, kv=kv_f() if kv_f else None, proj=proj_f() if proj_f else None)
    dec.compile(backend=backend, **({} if regional is None else {"regional": regional}))
    ids = e2e.random_prompt(1, context, dec.session.vocab_size, dec.device)
    row: dict = {"policy": name, "backend": backend, "context": context, "layers": len(model.model.layers),
                 "regional": dec.session.compiled_steps.regional, "device": str(dec.device),
                 "torch": torch.__version__}
    times = []
    for _ in range(2):  # the first compiles, warms up and captures; the second replays
        common.sync()
        t0 = time.perf_counter()
        dec.generate(ids, new_tokens)
        common.sync()
        times.append(time.perf_counter() - t0)
    row.update({"first_s": times[0], "steady_s": times[1], "compile_s": times[0] - times[1]})
    if step_ms:  # the compiled step alone at the prompt's end, as `timing.time_step` times it
        dec.session.rewind(context)
        row["step_ms"] = time_step(dec.session, calls=max(1, new_tokens - 2), reps=3)
    row.update(_phases())
    row["graphs"] = counters["stats"]["unique_graphs"]
    row["fx_calls"] = counters["stats"]["calls_captured"]
    row["recompiles"] = sum(counters["recompiles"].values())
    row["graph_breaks"] = sum(counters["graph_break"].values())
    if backend == "inductor":
        from torch._inductor import metrics

        row["kernels"] = metrics.generated_kernel_count
        row["ir_nodes"] = metrics.ir_nodes_pre_fusion
    return row


# ------------------------------------------------------------------------------ in the parent
def run_isolated(name: str, *, shape: str = "llama-3.1-8b", context: int = 32768, new_tokens: int = 8, layers: int | None = None,
                 tiny: bool = False, backend: str = "inductor", regional: bool | None = None, step_ms: bool = True,
                 timeout: float = 900.0, env: dict | None = None) -> dict:
    """`measure` in a fresh subprocess with a cold Inductor and Triton cache, within ``timeout``
    seconds. A child that fails or runs out of time gives a row with an ``error`` (and ``timeout``)."""
    with tempfile.TemporaryDirectory(prefix="pz-compile-") as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "benchmarks.compile_time", "--policy", name, "--model", shape, "--context", str(context),
               "--new-tokens", str(new_tokens), "--backend", backend, "--json", str(out)]
        if layers:
            cmd += ["--layers", str(layers)]
        if tiny:
            cmd += ["--tiny"]
        if regional is not None:
            cmd += ["--regional" if regional else "--whole"]
        if not step_ms:
            cmd += ["--no-step-ms"]
        child_env = dict(os.environ if env is None else env)
        child_env.update(TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"), TRITON_CACHE_DIR=str(Path(tmp) / "triton"))
        row: dict = {"policy": name, "backend": backend, "context": context}
        if regional is not None:
            row["regional"] = regional
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            row.update({"error": f"timeout after {timeout:.0f} s", "timeout": True, "wall_s": time.perf_counter() - t0})
            return row
        row["wall_s"] = time.perf_counter() - t0
        if res.returncode != 0 or not out.is_file():
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit status {res.returncode}"]
            row["error"] = f"child failed: {tail[0]}"[:300]
            return row
        row.update(json.loads(out.read_text()))
        return row


def main(argv=None) -> None:
    from policyzoo.bytes import BUILTIN

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, choices=sorted(policies()))
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(BUILTIN))
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="toy widths of the same structure (CPU)")
    p.add_argument("--backend", default="inductor")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--regional", dest="regional", action="store_const", const=True, default=None,
                     help="compile one layer for all (Decoder.compile(regional=True))")
    how.add_argument("--whole", dest="regional", action="store_const", const=False, help="compile the whole step")
    p.add_argument("--no-step-ms", dest="step_ms", action="store_false", help="skip timing the compiled step alone")
    p.add_argument("--json", default=None, help="write the row here (else print it)")
    args = p.parse_args(argv)
    row = measure(args.policy, shape=args.model, context=args.context, new_tokens=args.new_tokens, layers=args.layers,
                  tiny=args.tiny, backend=args.backend, regional=args.regional, step_ms=args.step_ms)
    text = json.dumps(row, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
