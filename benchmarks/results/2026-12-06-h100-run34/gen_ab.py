"""`generate` with the key sketch recoded inside the cache append (this tree) against the previous
`PagedKVCache.write` (the append, then the torch recode), both in one process: a Decoder built with
each, `Quest(0.1, bound="sketch")`, Llama-3.1-8B shape, random bf16 weights, batch 1, compiled with a
dynamic capacity, `benchmarks.e2e.measure` (EOS id and a streamer, 64 new tokens, prefill excluded).
Order: new, previous, new again. From the repository root on a CUDA machine:

    python benchmarks/results/2026-12-06-h100-run34/gen_ab.py 32768 [layers] out.json
"""
import json
import sys

import torch

from benchmarks import common, e2e
from policyzoo import kernels
from policyzoo.cache import SUMMARIES, PagedKVCache

n = int(sys.argv[1])
layers = int(sys.argv[2]) if len(sys.argv) > 3 else None
out = sys.argv[-1]
fused_write = PagedKVCache.write


def previous_write(self, layer, k, v):
    kept = tuple(getattr(self, name)[layer] if self.keeps(name) else None for name in SUMMARIES)
    kernels.cache_append(k, v, self.keys[layer], self.values[layer], kept, self.start, self.length, self.page_size)
    if self.keeps("key_sketch"):
        self._encode(layer, torch.div(self.length - 1, self.page_size, rounding_mode="floor").reshape(1))


model = common.random_model("llama-3.1-8b", layers)
rows = []
for label, write in (("fused", fused_write), ("previous", previous_write), ("fused again", fused_write)):
    PagedKVCache.write = write
    torch._dynamo.reset()
    dec = common.decoder(model, "quest0.1-sketch").compile(dynamic_capacity=True)
    row = {"write": label, "context": n, "layers": layers or model.config.num_hidden_layers}
    row.update(e2e.measure(dec, 1, n, 64))
    print(f"{label:<12} generate {row['generate_ms']:.3f} ms/token, step {row['step_ms']:.3f} ms, setup {row['setup_s']:.1f} s, "
          f"fallbacks {row['fallbacks']}", flush=True)
    rows.append(row)
    json.dump(rows, open(out, "w"), indent=1)
    del dec
    torch.cuda.empty_cache()
PagedKVCache.write = fused_write
