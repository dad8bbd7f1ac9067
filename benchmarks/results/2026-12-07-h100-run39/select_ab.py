"""Run 39: one layer's selection (`benchmarks.select_bench`: the policy's whole choice, compiled and
graph-replayed, and the attention over it) with the key sketch's "rows" method, then "half2", then
"rows" again, in one process. From the repository root on a CUDA machine:

    python benchmarks/results/2026-12-07-h100-run39/select_ab.py 131072 out.json
"""
import json
import sys

import torch

from benchmarks import select_bench
from policyzoo.kernels import SketchScoreConfig
from policyzoo.kernels.config import override

contexts, out = sys.argv[1], sys.argv[2]
rows = []
for label, method in (("rows", "rows"), ("half2", "half2"), ("rows again", "rows")):
    torch._dynamo.reset()
    with override(sketch_score=SketchScoreConfig(method=method)):
        got = select_bench.main(["--contexts", contexts, "--policies", "quest0.1,quest0.1-sketch,quest0.1-nominate4"])
    rows += [dict(r, variant=label) for r in got]
    json.dump(rows, open(out, "w"), indent=1)
    print(f"--- {label} done", flush=True)
