"""Run 39: `generate` with the key sketch's "half2" method against "rows", in one process: a Decoder
built under each `SketchScoreConfig`, Llama-3.1-8B shape, random bf16 weights, batch 1, compiled with
a dynamic capacity, `benchmarks.e2e.measure` (EOS id and a streamer, 64 new tokens, prefill
excluded). Order: rows, half2, dense, rows again, half2 again (as many as the time allows). From the
repository root on a CUDA machine:

    python benchmarks/results/2026-12-07-h100-run39/gen_ab.py 131072 quest0.1-sketch out.json
"""
import json
import sys

import torch

from benchmarks import common, e2e
from policyzoo.kernels import SketchScoreConfig
from policyzoo.kernels.config import override

n, setting, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
model = common.random_model("llama-3.1-8b", None)
rows = []
for label, name, method in (("rows", setting, "rows"), ("half2", setting, "half2"), ("dense", "dense", "rows"),
                            ("rows again", setting, "rows"), ("half2 again", setting, "half2")):
    torch._dynamo.reset()
    with override(sketch_score=SketchScoreConfig(method=method)):
        dec = common.decoder(model, name).compile(dynamic_capacity=True)
        row = {"variant": label, "setting": name, "method": method, "context": n}
        row.update(e2e.measure(dec, 1, n, 64))
    print(f"{label:<12} {name:<20} generate {row['generate_ms']:.3f} ms/token, step {row['step_ms']:.3f} ms, "
          f"setup {row['setup_s']:.1f} s, fallbacks {row['fallbacks']}", flush=True)
    rows.append(row)
    json.dump(rows, open(out, "w"), indent=1)
    del dec
    torch.cuda.empty_cache()
