"""Gate benchmark: per-request dispatch by a calibrated `Gate` against fixed settings, on a mixed request set.

Run on a CUDA machine (Llama-3.1-8B shape, random bf16 weights: speed does not depend on weight
values at fixed budgets):

    python -m benchmarks.gate_bench --out benchmarks/results/gate
    python -m benchmarks.gate_bench --tiny --out /tmp/gate   # on a CPU: a smoke test of the logic

What it does:
  1. builds one Decoder with the KV policy (``--kv``, a spec; default Quest at keep ``--kv-keep`` 0.2,
     pages of 16, window 64) and the projection sparsifier (``--proj``, a spec; default
     TopK(``--proj-keep`` 0.5)), compiled on CUDA;
  2. calibrates a Gate on that Decoder (`Gate.calibrate`, contexts ``--calib-contexts``) and saves it;
     ``--quality`` (a JSON file: a plain {setting: ppl increase} dict or eval results, see
     `policyzoo.gate.load_quality`) with ``--max-ppl-increase`` adds the quality budget;
  3. builds a mixed request set: ``--repeat`` requests at each context of ``--request-contexts``
     (default 1K to 64K), shuffled with ``--seed``; each request decodes ``--new-tokens`` steps;
  4. for each request, in order, fills the cache with random keys and values at its context (as in
     `benchmarks.sweep`: no prefill, whose cost is the same for every policy and which the gate
     does not choose), then decodes ``--new-tokens - 1`` steps from that context under each dispatch
     policy (``gate``; ``always-both``, ``always-proj``, ``always-kv``, ``always-dense``; their order
     rotates from request to request, so no policy always runs first) on the same Decoder, timed with
     CUDA events (wall clock on CPU). The gate chooses for the context the Decoder would use (prompt +
     new_tokens // 2). Every setting is warmed up (compiled) before timing.
  5. writes ``gate_bench.json`` (meta, gate file content, one row per policy and request, a summary per
     policy) and ``gate_bench.md`` (summary: total decode time, speedup over always-both /
     always-proj / always-dense, and the gate's regret against the per-request best fixed setting
     measured; then the per-request table).

``--check-generate N`` also runs the gated Decoder's own ``generate`` on random prompts of the
requests up to N tokens and checks that ``last_choice`` is the setting the benchmark dispatched.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from policyzoo import Decoder, Quest, TopK
from policyzoo.bytes import SETTINGS, ByteAccount, format_context, parse_tokens
from policyzoo.gate import Gate, device_name
from policyzoo.spec import parse_kv, parse_proj
from policyzoo.timing import time_ms

from .common import DEVICE, calibrated, fill_cache, llama8b

POLICIES = ("gate", "always-both", "always-proj", "always-kv", "always-dense")


def decode_ms(dec: Decoder, steps: int) -> float:
    """Milliseconds of ``steps`` decode steps from the current cache length (the context grows), by
    the shared timer (CUDA events on CUDA)."""
    return steps * time_ms(dec.session.step, calls=steps, reps=1, warmup=0, device=dec.device)


def run(args: argparse.Namespace) -> dict:
    device = DEVICE
    model = llama8b(device, args.layers, args.tiny)
    kv = parse_kv(args.kv) if args.kv else Quest(args.kv_keep, page=16, window=args.window)
    proj = calibrated(parse_proj(args.proj), model) if args.proj else TopK(args.proj_keep)
    dec = Decoder(model, kv=kv, proj=proj, compile=args.compile)
    calib = [parse_tokens(c) for c in args.calib_contexts.split(",")]
    contexts = [parse_tokens(c) for c in args.request_contexts.split(",")]
    requests = [n for n in contexts for _ in range(args.repeat)]
    random.Random(args.seed).shuffle(requests)
    new = args.new_tokens
    capacity = max(max(requests) + new, max(calib)) + 64

    gen = torch.Generator(device=device).manual_seed(args.seed)
    fill_cache(dec, 1, min(calib), capacity, gen)  # the cache at its final size: calibration reuses it (no recompile later)
    t0 = time.perf_counter()
    quality = json.loads(Path(args.quality).read_text()) if args.quality else None
    gate = Gate.calibrate(dec, contexts=calib, steps=args.calib_steps, reps=args.calib_reps, warmup=3 if args.compile else 1,
                          quality=quality, max_ppl_increase=args.max_ppl_increase, progress=not args.no_progress)  # fmt: skip
    calib_s = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gate.save(out / "gate.json")
    print(f"calibrated in {calib_s:.1f} s on {gate.device}")
    for n in contexts:
        print(gate.explain(n + new // 2))

    available = dec.available_settings()
    rows: list[dict] = []
    for s in available:  # warm-up: compile each setting's step once, outside the timed runs
        dec.use(s)
        fill_cache(dec, 1, min(requests), capacity, gen)
        decode_ms(dec, 3)
    for i, n in enumerate(requests):
        context = n + new // 2
        for k in range(len(POLICIES)):  # every policy on this request, in an order that rotates
            policy = POLICIES[(i + k) % len(POLICIES)]
            setting = gate.choose(context, available) if policy == "gate" else policy.removeprefix("always-")
            dec.use(setting)
            fill_cache(dec, 1, n, capacity, gen)  # each policy decodes from the same context, its own state
            ms = decode_ms(dec, new - 1)  # the first new token comes from the prefill
            rows.append({"policy": policy, "request": i, "context": n, "setting": setting, "ms": ms,
                         "ms_per_step": ms / (new - 1), "predicted_ms_per_step": gate.predict(setting, context)})  # fmt: skip
    for policy in POLICIES:
        total = sum(r["ms"] for r in rows if r["policy"] == policy)
        print(f"{policy:<13} {total:10.1f} ms over {len(requests)} requests", flush=True)
    checks = []
    if args.check_generate:
        dec.gate = gate
        for n in sorted(set(requests)):
            if n > args.check_generate:
                continue
            ids = torch.randint(1, int(model.config.vocab_size), (1, n), generator=gen, device=device)
            dec.generate(ids, new)
            expected = gate.choose(n + new // 2, available)
            checks.append({"context": n, "last_choice": dec.last_choice, "expected": expected, "ok": dec.last_choice == expected})
        dec.gate = None
        assert all(c["ok"] for c in checks), f"generate dispatched differently: {checks}"
    summary = summarise(rows, requests)
    meta = {
        "device": device_name(device), "date": dt.date.today().isoformat(), "torch": torch.__version__,
        "python": platform.python_version(), "model": "tiny llama" if args.tiny else "llama-3.1-8b shape (random bf16)",
        "layers": model.config.num_hidden_layers, "compile": args.compile, "kv": repr(kv), "proj": repr(proj),
        "new_tokens": new, "requests": requests, "calibration_s": calib_s,
        "note": "decode steps only (random cache fill at each request's context, no prefill); CUDA events on CUDA",
    }  # fmt: skip
    if not args.tiny:
        acct = ByteAccount.from_config("llama-3.1-8b")
        budget = getattr(kv, "budget", None)  # a keep ratio, or tokens (then the --kv-keep default stands in)
        r_kv = budget if isinstance(budget, float) and budget <= 1 else args.kv_keep
        meta["byte_crossover_K"] = acct.crossover(proj.keep, r_kv) / 1024
    record = {"meta": meta, "gate": gate.to_dict(), "rows": rows, "summary": summary, "generate_checks": checks}
    (out / "gate_bench.json").write_text(json.dumps(record, indent=1))
    (out / "gate_bench.md").write_text(markdown(record))
    print((out / "gate_bench.md").read_text())
    return record


def summarise(rows: list[dict], requests: list[int]) -> dict:
    """Per policy: total decode ms, and the per-request best fixed setting (the oracle) for regret."""
    total = {p: sum(r["ms"] for r in rows if r["policy"] == p) for p in POLICIES}
    best = {}
    for i in range(len(requests)):
        fixed = [r for r in rows if r["request"] == i and r["policy"] != "gate"]
        best[i] = min(fixed, key=lambda r: r["ms"])
    oracle = sum(r["ms"] for r in best.values())
    gate_rows = {r["request"]: r for r in rows if r["policy"] == "gate"}
    agree = sum(gate_rows[i]["setting"] == best[i]["setting"] for i in best)
    return {
        "total_ms": total,
        "oracle_ms": oracle,
        "gate_regret": total["gate"] / oracle - 1.0,
        "gate_matches_best_fixed": f"{agree}/{len(best)}",
        "speedup_of_gate": {p: total[p] / total["gate"] for p in POLICIES if p != "gate"},
    }


def ctx(n: int) -> str:
    """``32K`` from 1K up, plain tokens below."""
    return format_context(n) if n >= 1024 else str(n)


def markdown(record: dict) -> str:
    meta, s, rows = record["meta"], record["summary"], record["rows"]
    lines = [
        f"# Gate benchmark — {meta['device']}, {meta['date']}", "",
        f"{meta['model']}, {meta['layers']} layers, compile={meta['compile']}; KV policy `{meta['kv']}`, "
        f"projections `{meta['proj']}`; {len(meta['requests'])} requests, {meta['new_tokens']} new tokens each "
        f"({meta['note']}).", "",
        "| policy | total decode ms | gate's speedup over it |", "|---|---|---|",
    ]  # fmt: skip
    for p, ms in s["total_ms"].items():
        speedup = "—" if p == "gate" else f"{s['speedup_of_gate'][p]:.3f}x"
        lines.append(f"| {p} | {ms:.1f} | {speedup} |")
    lines += ["", f"Per-request best fixed setting (oracle): {s['oracle_ms']:.1f} ms; gate regret "
              f"{100 * s['gate_regret']:.1f}%; the gate picked the best measured setting for {s['gate_matches_best_fixed']} requests.", "",
              "| request | context | " + " | ".join(f"{p} ms/step" for p in POLICIES) + " | gate chose | predicted ms/step |",
              "|---|---|" + "---|" * (len(POLICIES) + 2)]  # fmt: skip
    by = {(r["policy"], r["request"]): r for r in rows}
    for i, n in enumerate(meta["requests"]):
        g = by[("gate", i)]
        cells = " | ".join(f"{by[(p, i)]['ms_per_step']:.3f}" for p in POLICIES)
        lines.append(f"| {i} | {ctx(n)} | {cells} | {g['setting']} | {g['predicted_ms_per_step']:.3f} |")
    gate = record["gate"]
    lines += ["", "Calibrated curves (ms per step):", "", "| setting | " + " | ".join(ctx(int(c)) for c in gate["curves"]["dense"]) + " |",
              "|---|" + "---|" * len(gate["curves"]["dense"])]  # fmt: skip
    for setting in SETTINGS:
        if setting in gate["curves"]:
            lines.append(f"| {setting} | " + " | ".join(f"{v:.3f}" for v in gate["curves"][setting].values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/gate"))
    p.add_argument("--tiny", action="store_true", help="a toy model of the same structure, small contexts (smoke test)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--kv-keep", type=float, default=0.2, help="Quest keep ratio (default 0.2)")
    p.add_argument("--window", type=int, default=64, help="Quest local window (default 64)")
    p.add_argument("--proj-keep", type=float, default=0.5, help="TopK keep ratio (default 0.5)")
    p.add_argument("--kv", default=None, help="the KV policy as a spec (e.g. quest:0.1); overrides --kv-keep and --window")
    p.add_argument("--proj", default=None, help="the sparsifier as a spec (e.g. threshold:0.5); overrides --proj-keep")
    p.add_argument("--calib-contexts", default=None, help="default 1k,4k,16k,64k (tiny: 64,128,256,512)")
    p.add_argument("--calib-steps", type=int, default=8)
    p.add_argument("--calib-reps", type=int, default=3)
    p.add_argument("--request-contexts", default=None, help="default 1k,2k,4k,8k,16k,32k,64k (tiny: 32..512)")
    p.add_argument("--repeat", type=int, default=2, help="requests per context (default 2)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per request (default 64; tiny 8)")
    p.add_argument("--quality", default=None, help="JSON: {setting: ppl increase} or eval results (see load_quality)")
    p.add_argument("--max-ppl-increase", type=float, default=None)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA only")
    p.add_argument("--check-generate", type=int, default=None, help="also check generate's dispatch up to N tokens (tiny: 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.compile is None:
        args.compile = DEVICE == "cuda"
    if args.tiny:
        args.calib_contexts = args.calib_contexts or "64,128,256,512"
        args.request_contexts = args.request_contexts or "32,64,128,256,512"
        args.new_tokens = args.new_tokens if "--new-tokens" in (sys.argv[1:] if argv is None else argv) else 8
        args.check_generate = args.check_generate or 512
    args.calib_contexts = args.calib_contexts or "1k,4k,16k,64k"
    args.request_contexts = args.request_contexts or "1k,2k,4k,8k,16k,32k,64k"
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (the first token comes from the prefill)")
    return run(args)


if __name__ == "__main__":
    main()
