"""Programmatic dependent launch (PDL) in Inductor's kernels, on and off (run once per setting of
TORCHINDUCTOR_ENABLE_PDL, from the repository root on a CUDA machine):

    TORCHINDUCTOR_ENABLE_PDL=1 python benchmarks/results/2026-12-06-h100-run34/pdl_check.py dense,threshold0.5 4096 8 out.json

Per setting: the greedy tokens of a 32-token `generate` from a fixed random prompt (to compare the
two modes token for token), then `benchmarks.e2e.measure` (generate ms/token and the step alone)."""
import json, os, sys
import torch
import torch._inductor.config as inductor_config
from benchmarks import common, e2e

names, n, layers, out = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
print("enable_pdl", inductor_config.triton.enable_pdl, flush=True)
model = common.random_model("llama-3.1-8b", layers)
rows = []
for name in names:
    dec = common.decoder(model, name).compile(dynamic_capacity=True)
    vocab = dec.session.vocab_size
    ids = e2e.random_prompt(1, n, vocab, dec.device, seed=1)
    toks = dec.generate(ids, 32, eos_token_id=vocab - 1)[0, n:].tolist()
    row = {"setting": name, "context": n, "layers": layers, "pdl": inductor_config.triton.enable_pdl, "tokens_32": toks}
    row.update(e2e.measure(dec, 1, n, 64))
    print(name, f"generate {row['generate_ms']:.3f} ms/token, step {row['step_ms']:.3f} ms, tokens {toks[:8]}...", flush=True)
    rows.append(row)
    del dec
    torch.cuda.empty_cache()
json.dump(rows, open(out, "w"), indent=1)
