"""`generate` with a page policy's choice from given scores made in one launch that finds the
visible and forced pages and the budget itself (`kv.choose.choose_page_scores`, this tree) against the
previous step (those as torch operations, then `kernels.select_scores`), in one process: Llama-3.1-8B
shape, random bf16 weights, batch 1, compiled with a dynamic capacity, `benchmarks.e2e.measure`
(EOS id and a streamer, 64 new tokens, prefill excluded). Per context: dense, then each setting new,
previous, new again. From the repository root on a CUDA machine:

    [CONTEXTS=32768] python benchmarks/results/2026-12-06-offline-run35/select_ab.py out.json [deadline_s]
"""
import json
import os
import sys
import time

import torch

from benchmarks import common, e2e
from policyzoo import kernels
from policyzoo.kv import choose
from policyzoo.kv.base import Budget
from policyzoo.kv.scoring import page_count_rule

out = sys.argv[1]
deadline = time.perf_counter() + (float(sys.argv[2]) if len(sys.argv) > 2 else 1e9)
fused = choose.choose_page_scores


def previous(state, scores, k_max, count, sinks, window, ids=None):
    """The previous step: visibility, forcing and the budget as torch operations, then `select_scores`."""
    c, page = state.cache, state.page_size
    b, _, n = scores.shape
    listed = torch.arange(n, device=scores.device).expand(b, n) if ids is None else ids
    seen, forced = kernels.reference.page_flags(listed, c.start, c.length, page, sinks, window)
    if isinstance(count, Budget):
        count = kernels.reference.page_count(seen.sum(-1), *page_count_rule(count, page))
    seen = seen if seen.dim() == 3 else seen[:, None, :]
    return choose.choose_topk(scores.masked_fill(~seen, -torch.inf), forced, k_max, count,
                              block=page if ids is None else 1, workspace=state.workspace)


PLAN = {131072: ["quest0.1-sketch", "quest0.1-nominate4"], 32768: ["quest0.1-sketch"]}
if os.environ.get("CONTEXTS"):  # a subset, in the order given
    PLAN = {int(c): PLAN[int(c)] for c in os.environ["CONTEXTS"].split(",")}
model = common.random_model("llama-3.1-8b")
rows = []
for n, names in PLAN.items():
    runs = [("dense", "-")] + [(name, way) for name in names for way in ("new", "previous", "new again")]
    for name, way in runs:
        if time.perf_counter() > deadline:
            print("deadline: stopping", flush=True)
            break
        choose.choose_page_scores = previous if way == "previous" else fused
        torch._dynamo.reset()
        dec = common.decoder(model, name).compile(dynamic_capacity=True)
        row = {"setting": name, "choice": way, "context": n}
        row.update(e2e.measure(dec, 1, n, 64))
        print(f"{n:>7} {name:<20} {way:<10} generate {row['generate_ms']:.3f} ms/token, step {row['step_ms']:.3f} ms, "
              f"setup {row['setup_s']:.1f} s, fallbacks {row['fallbacks']}", flush=True)
        rows.append(row)
        json.dump(rows, open(out, "w"), indent=1)
        del dec
        torch.cuda.empty_cache()
choose.choose_page_scores = fused
