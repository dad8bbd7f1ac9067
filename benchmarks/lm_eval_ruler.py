"""RULER through lm-eval on the embedded SmolLM2: a few settings on RULER's offline tasks.

    python -m benchmarks.lm_eval_ruler --out benchmarks/results/smollm2-ruler --docs 0 10 --lengths 2048

For each setting (a KV policy spec), task and length, `lm_eval.simple_evaluate` runs the
``policyzoo`` model on the task's documents ``--docs FIRST END`` inside
`policyzoo.integrations.ruler.offline_ruler`; each run's results go to
``<out>/runs/<setting>__<task>__<length>__docs<FIRST>-<LAST>.json`` (lm-eval's config, and per
sample the response, the target and the score; not the prompt), and a run already there is skipped,
so an interrupted sweep resumes and a later range adds samples. ``<out>/results.md`` is the table:
RULER's score (the fraction of the expected strings found in the answer), averaged over every
sample of the runs of a task, length and setting.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

DEFAULT_SETTINGS = ("dense", "quest:0.1", "quest:0.1,bound=sketch", "window:sinks=4,window=256")
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "ruler_vt", "ruler_cwe")


def run_name(setting: str, task: str, length: int, docs: range) -> str:
    return f"{re.sub(r'[^A-Za-z0-9.=-]+', '_', setting)}__{task}__{length}__docs{docs.start}-{docs.stop - 1}"


def run_one(setting: str, task: str, length: int, docs: range, max_gen_toks: int | None, metadata: dict) -> dict:
    import lm_eval

    import policyzoo.integrations.lm_eval  # noqa: F401  (registers the model)

    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model="policyzoo", model_args={"pretrained": "smollm2-135m", "kv": setting, "device": "cpu"},
        tasks=[task], samples={task: list(docs)}, metadata={**metadata, "max_seq_lengths": [length]}, log_samples=True,
        gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks else None,
    )  # fmt: skip
    key = f"{length},none"
    samples = [
        {"doc_id": s["doc_id"], "response": s["resps"][0][0], "target": s["doc"]["outputs"], "score": s[str(length)],
         "prompt_tokens": s["doc"]["length"]}
        for s in results["samples"][task]
    ]  # fmt: skip
    return {
        "setting": setting, "task": task, "length": length, "docs": [docs.start, docs.stop],
        "score": results["results"][task][key], "n": len(samples), "seconds": round(time.perf_counter() - start, 1),
        "config": {k: v for k, v in results["config"].items() if isinstance(v, (str, int, float, bool, type(None), list, dict))},
        "versions": {"lm_eval": results.get("lm_eval_version"), "transformers": results.get("transformers_version")},
        "samples": samples,
    }  # fmt: skip


def table(runs: list[dict]) -> str:
    """Markdown: one row per setting, one column per task and length: RULER's score, the mean over
    every sample of its runs (the samples' count in the header), then per length the mean of the
    row's cells at that length."""
    scores: dict[tuple[str, str, int], list[float]] = {}
    for r in runs:
        scores.setdefault((r["setting"], r["task"], r["length"]), []).extend(s["score"] for s in r["samples"])
    order = {t: i for i, t in enumerate(DEFAULT_TASKS)}
    columns = sorted({(t, n) for _, t, n in scores}, key=lambda c: (c[1], order.get(c[0], len(order)), c[0]))
    lengths = sorted({n for _, n in columns})
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    counts = {c: max(len(v) for (_, t, n), v in scores.items() if (t, n) == c) for c in columns}
    head = [f"{t} {n} (n={counts[(t, n)]})" for t, n in columns] + [f"mean {n}" for n in lengths]
    lines = ["| setting | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for s in settings:
        cell = {(t, n): sum(v) / len(v) for (name, t, n), v in scores.items() if name == s and v}
        text = [f"{cell[c]:.2f}" if c in cell else "—" for c in columns]
        for n in lengths:
            at = [v for (_, m), v in cell.items() if m == n]
            text.append(f"{sum(at) / len(at):.2f}" if at else "—")
        lines.append(f"| `{s}` | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS), help="KV policy specs")
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS))
    p.add_argument("--lengths", nargs="+", type=int, default=[2048])
    p.add_argument("--docs", nargs=2, type=int, default=[0, 5], metavar=("FIRST", "END"), help="the task's documents FIRST..END-1")
    p.add_argument("--max-gen-toks", type=int, default=None, help="override the tasks' max_gen_toks (RULER's: 128, vt 30)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (1 on a shared CPU)")
    args = p.parse_args(argv)

    import torch

    from policyzoo.integrations.ruler import offline_ruler

    if args.threads:
        torch.set_num_threads(args.threads)
    runs_dir = args.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    with offline_ruler() as metadata:
        for length in args.lengths:
            for task in args.tasks:
                for setting in args.settings:
                    docs = range(*args.docs)
                    path = runs_dir / f"{run_name(setting, task, length, docs)}.json"
                    if path.exists():
                        continue
                    run = run_one(setting, task, length, docs, args.max_gen_toks, metadata)
                    path.write_text(json.dumps(run, indent=1) + "\n")
                    print(f"{setting:28s} {task:16s} {length:6d}  score {run['score']:.2f}  n {run['n']}  {run['seconds']} s", flush=True)
    runs = [json.loads(f.read_text()) for f in sorted(runs_dir.glob("*.json"))]
    (args.out / "results.md").write_text(table(runs))
    print(table(runs))


if __name__ == "__main__":
    main()
