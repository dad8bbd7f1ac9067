"""Run 40: `generate` with the key sketch's "half2" kernel under a register cap
(`SketchScoreConfig(max_registers=...)`) against the compiler's choice, in one process: a Decoder built
under each config, Llama-3.1-8B shape, random bf16 weights, batch 1, compiled with a dynamic capacity,
`benchmarks.e2e.measure` (EOS id and a streamer, 64 new tokens, prefill excluded). Order: no cap, the
cap, dense, no cap again, the cap again (as many as the time allows). From the repository root on a
CUDA machine:

    python benchmarks/results/2026-12-07-h100-run40/gen_caps.py 131072 quest0.1-sketch 200 out.json
"""
import json
import sys

import torch

from benchmarks import common, e2e
from policyzoo.kernels import SketchScoreConfig
from policyzoo.kernels.config import override

n, setting, cap, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
model = common.random_model("llama-3.1-8b", None)
rows = []
for label, name, regs in (("no cap", setting, 0), (f"cap {cap}", setting, cap), ("dense", "dense", 0),
                          ("no cap again", setting, 0), (f"cap {cap} again", setting, cap)):
    torch._dynamo.reset()
    with override(sketch_score=SketchScoreConfig(max_registers=regs)):
        dec = common.decoder(model, name).compile(dynamic_capacity=True)
        row = {"variant": label, "setting": name, "max_registers": regs, "context": n}
        row.update(e2e.measure(dec, 1, n, 64))
    print(f"{label:<16} {name:<20} generate {row['generate_ms']:.3f} ms/token, step {row['step_ms']:.3f} ms, "
          f"setup {row['setup_s']:.1f} s, fallbacks {row['fallbacks']}", flush=True)
    rows.append(row)
    json.dump(rows, open(out, "w"), indent=1)
    del dec
    torch.cuda.empty_cache()
