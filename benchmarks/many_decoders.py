"""Many compiled Decoders in one process, each as fast as it is alone.

The natural way to compare policies: one model, and for each setting in turn a fresh
``Decoder(model, kv=...).compile()`` used for prompts of several lengths (a fixed cache capacity per
prompt: one compile each). Every row times `Decoder.generate` as users call it (an EOS id, a
streamer; `benchmarks.e2e.measure`) with its compiled step beside it, and counts the
`CompileFallbackWarning`s the row raised. ``--fresh`` then runs each setting again in a process of
its own (the same commands, one setting each), and the table puts the two figures side by side::

    python -m benchmarks.many_decoders --out DIR --fresh          # on the GPU: the committed run
    python -m benchmarks.many_decoders --tiny --out DIR --fresh   # CPU smoke test (timings mean nothing)

It writes ``many_decoders.json`` and ``many_decoders.md``: per setting and context, ms/token in the
shared process and alone, their ratio, the step, the byte floor and the ideal speedup bound.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import common, e2e
from benchmarks.sweep import copy_bandwidth
from policyzoo.bytes import BUILTIN, ByteAccount

# The sequence that fell back to eager from its fifth Decoder on before compiled steps had code of
# their own: dense first (every ratio divides by it).
SEQUENCE = "dense,quest0.1,quest0.2,quest0.1-sketch,window4+512,attn-topk0.1,ssa0.05+0.05,quest0.1p64,quest0.3"


def measure_row(dec, row: dict, n: int, new_tokens: int, acct: ByteAccount, bw: float, r_p: float, log) -> dict:
    """Time ``dec``'s `generate` at context ``n`` into ``row``, with its fallbacks, floor, bound and
    the GPU's clocks, temperature and power as the row ended (`common.gpu_state`)."""
    name = row["setting"]
    with common.recorded(row, f"{name} n={n}"):
        row.update(e2e.measure(dec, 1, n, new_tokens))  # its fallbacks included (``fallbacks``, ``fallback``)
        row.update(common.gpu_state())
        row["floor_ms"] = acct.floor_ms(n, bw, r_p, common.kv_ratio(name, n), r_select=common.selection_ratio(name))
        row["bound"] = acct.floor_ms(n, bw, 1.0, 1.0) / row["floor_ms"]
        log(f"{row['order']} {name:<18} n={n:>6}: generate {row['generate_ms']:.3f} ms/token, step {row['step_ms']:.3f} ms, "
            f"floor {row['floor_ms']:.3f} ms, fallbacks {row['fallbacks']}, gpu {row.get('gpu_state', '?')}")
    return row


def run_settings(model, names: list[str], contexts: list[int], new_tokens: int, acct: ByteAccount, bw: float, log,
                 backend: str = "inductor", retime_first: float | None = None, recapture: int = 0) -> list[dict]:
    """One row per (setting, context), every setting a fresh compiled Decoder on ``model``.

    ``retime_first`` (seconds): after the sequence, a fresh Decoder of the first setting is timed at
    once and again after that many seconds of an idle GPU. A slowdown that follows the process's
    earlier captures stays after the pause; one that follows the GPU's state (clocks, temperature)
    goes.

    ``recapture``: the first Decoder's CUDA graphs are dropped and captured again that many times,
    each capture timed (no new compile): whether a replay slows with the captures made before it."""
    rows = []
    probe = retime_first is not None or recapture
    section = "many-retime" if probe else "many"  # a probe: LATEST.md keeps the plain sequence
    plan = [(order, name) for order, name in enumerate(names, 1)]
    for order, name in plan + ([("again", names[0])] if retime_first is not None else []):
        dec = common.decoder(model, name).compile(backend=backend)
        r_p = common.settings()[name][2]
        waits = [("", 0.0)] if order != "again" else [("1, again", 0.0), (f"1, after {retime_first:.0f} s idle", retime_first)]
        if order == 1 and recapture:
            waits += [(f"1, captured {k + 2} times", 0.0) for k in range(recapture)]
        for label, wait in waits:
            time.sleep(wait)
            if "captured" in label:
                dec.session.compiled_steps.drop_graphs()
                common.free_memory()  # the dropped graphs and their pools released before the next capture
            for n in contexts:
                row = {"section": section, "mode": "compiled", "order": label or order, "setting": name, "context": n, "batch": 1}
                rows.append(measure_row(dec, row, n, new_tokens, acct, bw, r_p, log))
        del dec
        common.free_memory()
    return rows


def add_ratios(rows: list[dict]) -> None:
    """``x dense`` per row: dense's ms/token at the same context (and column) over the row's."""
    for column in ("generate_ms", "fresh_generate_ms"):
        dense: dict[int, float] = {}
        for r in rows:  # the first dense row of each context
            if r["setting"] == "dense" and column in r:
                dense.setdefault(r["context"], r[column])
        for r in rows:
            if column in r and r["context"] in dense:
                r[column.replace("generate_ms", "x_dense")] = dense[r["context"]] / r[column]
    for r in rows:
        if "fresh_generate_ms" in r:
            r["shared/alone"] = r["generate_ms"] / r["fresh_generate_ms"]


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "many_decoders.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Many compiled Decoders in one process — {meta['gpu']}, {meta['date']}", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}; model shape {meta['model']} (random weights), "
             f"batch 1, {meta['new_tokens']} new tokens per `generate` (an EOS id set, a streamer attached; prefill excluded). "
             "One process builds and compiles a fresh Decoder per setting, in this order, each for every context; "
             "`alone` is the same setting compiled in a process of its own. Floor: step bytes (`policyzoo.bytes`) "
             f"over the copy bandwidth ({meta['bandwidth_TBps']:.3g} TB/s); bound: the ideal speedup over dense from bytes.", "",
             "| order | setting | context | ms/token (one process) | ms/token (alone) | one process / alone | step ms | floor ms | "
             "x dense | bound | fallbacks |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['order']} | {r['setting']} | {r['context']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        alone = r.get("fresh_generate_ms")
        cells = [r["order"], r["setting"], r["context"], f"{r['generate_ms']:.3f}", f"{alone:.3f}" if alone else "—",
                 f"{r['generate_ms'] / alone:.3f}" if alone else "—", f"{r['step_ms']:.3f}", f"{r['floor_ms']:.3f}",
                 f"{r.get('x_dense', float('nan')):.2f}", f"{r['bound']:.2f}", r["fallbacks"]]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    (out / "many_decoders.md").write_text("\n".join(lines) + "\n")


def run_alone(rows: list[dict], args, log) -> None:
    """Each setting of ``rows`` again in a process of its own; its figures join the rows (``fresh_*``)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in dict.fromkeys(r["setting"] for r in rows):
        path = out / f".alone-{name}.json"
        contexts = ",".join(str(r["context"]) for r in rows if r["setting"] == name)
        cmd = [sys.executable, "-m", "benchmarks.many_decoders", "--settings", name, "--contexts", contexts,
               "--new-tokens", str(args.new_tokens), "--model", args.model, "--backend", args.backend, "--json", str(path)] + (["--tiny"] if args.tiny else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            log(f"alone {name}: FAILED\n{done.stderr[-2000:]}")
            continue
        alone = {r["context"]: r for r in json.loads(path.read_text())}
        path.unlink()
        for r in rows:
            if r["setting"] == name and "generate_ms" in alone.get(r["context"], {}):
                r["fresh_generate_ms"], r["fresh_step_ms"] = alone[r["context"]]["generate_ms"], alone[r["context"]]["step_ms"]
                log(f"alone {name} n={r['context']}: {r['fresh_generate_ms']:.3f} ms/token "
                    f"(one process {r['generate_ms']:.3f}: x{r['generate_ms'] / r['fresh_generate_ms']:.3f})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--settings", default=SEQUENCE, help="settings (benchmarks.common.settings), in order")
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(BUILTIN))
    p.add_argument("--tiny", action="store_true", help="a toy model of the same structure (CPU smoke test)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (eager: the smoke test's, Dynamo alone)")
    p.add_argument("--fresh", action="store_true", help="then each setting again in a process of its own")
    p.add_argument("--alone-for", default=None,
                   help="a many_decoders.json written before: run only its settings' processes of their own, and add them")
    p.add_argument("--retime-first", type=float, default=None, metavar="SECONDS",
                   help="after the sequence, time a fresh Decoder of the first setting, then again after SECONDS idle")
    p.add_argument("--recapture", type=int, default=0, metavar="N",
                   help="drop the first Decoder's CUDA graphs and capture them again N times, timing each")
    p.add_argument("--json", default=None, help="(internal) write this process's rows here and exit")
    args = p.parse_args(argv)
    import transformers

    t0 = time.perf_counter()
    log = lambda line: print(f"[{time.perf_counter() - t0:6.0f}s] {line}", flush=True)  # noqa: E731
    if args.alone_for:
        saved = json.loads(Path(args.alone_for).read_text())
        meta, rows = saved["meta"], saved["rows"]
        args.model, args.new_tokens, args.tiny, args.backend = meta["shape"], meta["new_tokens"], meta["model"] == "tiny", meta["backend"]
    else:
        names, contexts = args.settings.split(","), [int(c) for c in args.contexts.split(",")]
        model = common.random_model(args.model, tiny=args.tiny)
        dtype = next(model.parameters()).dtype
        acct = ByteAccount.from_config(model.config, dtype=dtype) if args.tiny else ByteAccount.from_config(args.model)
        bw = copy_bandwidth()
        rows = run_settings(model, names, contexts, args.new_tokens, acct, bw, log, args.backend, args.retime_first, args.recapture)
        if args.json:
            Path(args.json).write_text(json.dumps(rows))
            return
        del model
        common.free_memory()
        meta = {"gpu": torch.cuda.get_device_name() if common.DEVICE == "cuda" else "cpu (smoke test)", "date": dt.date.today().isoformat(),
                "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
                "model": "tiny" if args.tiny else args.model, "shape": args.model, "new_tokens": args.new_tokens,
                "backend": args.backend, "bandwidth_TBps": bw / 1e12, "source": common.source_digest()}  # fmt: skip
    add_ratios(rows)
    write(Path(args.out), meta, rows)  # the shared process's figures are kept whatever happens next
    if args.fresh or args.alone_for:
        run_alone(rows, args, log)
        add_ratios(rows)
        write(Path(args.out), meta, rows)


if __name__ == "__main__":
    main()
