"""Where a decode step's time goes: a per-kernel trace of the step as `generate` replays it.

The compiled step of a setting is captured in a CUDA graph as `Decoder.generate` runs it, then a
few replays are traced with the profiler (CUPTI sees the kernels inside a graph). From the kernels'
start and end times it reports, per step: the wall time of the replay, the kernels' busy time, the
idle gaps between consecutive kernels (count, sum, the largest ones with the kernels around them),
the kernels per step and per layer, and the kernels by name; beside it, the time a `session.step()`
call takes the host to return and the device to finish, the device's idle time between replays,
and the host's busiest operations (a host that needs longer than the device sets the pace)::

    python -m benchmarks.trace_step --settings dense@4096,threshold0.5@4096 --out $OUT

Run it on a CUDA machine (random bf16 weights of the 8B shape; `--layers` for fewer). On the CPU it
only checks that it runs (`--tiny`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

import torch

from policyzoo.synthetic import fill_random

from . import common


def kernel_events(prof, copies: bool = False) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of every device kernel the profiler saw, by start (with
    ``copies``: the memcpy and memset operations instead)."""
    out = []
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.name.startswith(("Memcpy", "Memset")) == copies:
            start, end = e.time_range.start, e.time_range.end
            if end > start:
                out.append((start, end, e.name))
    return sorted(out)


def between_replays(steps: list[list]) -> list[float]:
    """The device's idle time from the last kernel of one replay to the first of the next."""
    return [steps[i + 1][0][0] - steps[i][-1][1] for i in range(len(steps) - 1)]


def host_and_step_us(session, n: int, calls: int = 20) -> tuple[float, float]:
    """``(host, step)`` µs per `session.step()` over ``calls`` back-to-back calls: the host's time
    to return from the calls (no sync inside), and the time until the device has finished them. A
    host time close to the step time means the host, not the device, sets the pace."""
    import time

    session.rewind(n)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        session.step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def split_steps(kernels: list, steps: int) -> list[list]:
    """The kernels of each replay: ``steps`` equal runs of the sorted kernel list."""
    per = len(kernels) // steps
    return [kernels[i * per : (i + 1) * per] for i in range(steps)]


def step_report(step: list, layers: int, top: int = 8) -> dict:
    busy = sum(end - start for start, end, _ in step)
    gaps = [(step[i + 1][0] - step[i][1], step[i][2], step[i + 1][2]) for i in range(len(step) - 1)]
    idle = [g for g in gaps if g[0] > 0]
    wall = step[-1][1] - step[0][0]
    return {
        "wall_us": wall, "busy_us": busy, "gap_us": sum(g[0] for g in idle), "gaps": len(idle),
        "kernels": len(step), "kernels_per_layer": len(step) / layers,
        "median_gap_us": statistics.median([g[0] for g in idle]) if idle else 0.0,
        "largest_gaps": [{"us": round(g, 2), "after": a[:60], "before": b[:60]} for g, a, b in sorted(idle, reverse=True)[:top]],
    }


def trace(model, name: str, n: int, steps: int, out: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    dec = common.decoder(model, name).compile()
    fill_random(dec.session, n, capacity=n + 64 + 4 * steps)
    session = dec.session
    for _ in range(4):  # compile, warm up, capture the CUDA graph
        session.step()
    host_us, step_us = host_and_step_us(session, n)
    session.rewind(n)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            session.step()
        torch.cuda.synchronize()
    kernels = kernel_events(prof)
    copies = kernel_events(prof, copies=True)
    layers = len(model.model.layers)
    per_step = split_steps(kernels, steps)
    reports = [step_report(s, layers) for s in per_step]
    cpu = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    names = Counter(k[2][:80] for k in kernels)
    time_by = Counter()
    for start, end, k in kernels:
        time_by[k[:80]] += (end - start) / steps
    row = {"setting": name, "context": n, "layers": layers, "steps": steps,
           **{key: statistics.median(r[key] for r in reports) for key in ("wall_us", "busy_us", "gap_us", "gaps", "kernels")},
           "host_us": host_us, "step_us": step_us,
           "between_replays_us": statistics.median(between_replays(per_step)) if steps > 1 else 0.0,
           "copies_per_step": len(copies) / steps, "copies_us": sum(e - s for s, e, _ in copies) / steps,
           "host_ops": [{"op": e.key[:60], "self_cpu_us_per_step": round(e.self_cpu_time_total / steps, 1),
                         "calls_per_step": e.count / steps} for e in cpu],
           "kernels_per_layer": reports[0]["kernels_per_layer"], "largest_gaps": reports[len(reports) // 2]["largest_gaps"],
           "by_kernel": [{"kernel": k, "us": round(us, 1), "calls": names[k] // steps} for k, us in time_by.most_common(25)]}
    lines = [f"## {name} @ {n}: wall {row['wall_us']:.0f} us, kernels busy {row['busy_us']:.0f} us, idle gaps "
             f"{row['gap_us']:.0f} us in {row['gaps']:.0f} gaps; {row['kernels']:.0f} kernels ({row['kernels_per_layer']:.1f} per layer)",
             f"step {row['step_us']:.0f} us a call (host {row['host_us']:.0f} us to return from it), the device idle "
             f"{row['between_replays_us']:.0f} us between replays; {row['copies_per_step']:.0f} copies/memsets a step "
             f"({row['copies_us']:.0f} us)",
             "", "| kernel | us per step | calls per step |", "|---|---:|---:|"]
    lines += [f"| `{k['kernel']}` | {k['us']} | {k['calls']} |" for k in row["by_kernel"]]
    lines += ["", "| host op | self CPU us per step | calls per step |", "|---|---:|---:|"]
    lines += [f"| `{o['op']}` | {o['self_cpu_us_per_step']} | {o['calls_per_step']:g} |" for o in row["host_ops"]]
    lines += ["", "largest gaps: " + "; ".join(f"{g['us']} us after `{g['after']}`" for g in row["largest_gaps"])]
    text = "\n".join(lines)
    print(text, flush=True)
    (out / f"trace-{common.file_stem(name)}-{n}.md").write_text(text + "\n")
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="dense@4096,threshold0.5@4096")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if common.DEVICE != "cuda":
        raise SystemExit("trace_step needs a CUDA device (it traces a CUDA-graph replay)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = common.random_model(args.model, args.layers)
    rows = []
    for item in args.settings.split(","):
        name, n = item.split("@")
        rows.append(trace(model, name, int(n), args.steps, out))
        torch.cuda.empty_cache()
    (out / "trace.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
