"""Hugging Face's own ``generate`` inside `policyzoo.apply` against `Decoder.generate`, per token.

Both decode the same prompt with the same policy to the same number of new tokens (greedy, no EOS,
prefill excluded: the time to the first token is taken off); `Decoder.generate` eager and, on CUDA,
compiled. Prints a markdown table and, with ``--json``, writes the rows::

    python -m benchmarks.hf_generate --model smollm2-135m --context 1024 --new-tokens 32 --kv dense quest:0.1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import policyzoo
from policyzoo import Decoder
from policyzoo.assets import load_model
from policyzoo.spec import parse_kv


class Stamps:
    """A streamer that notes when each chunk of tokens reaches the host."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def ms_per_token(self) -> float:
        gaps = [b - a for a, b in zip(self.times[2:], self.times[3:])]  # after the prompt and the first token
        return 1e3 * statistics.median(gaps)


def time_path(run, reps: int) -> float:
    figures = []
    for _ in range(reps):
        stamps = Stamps()
        run(stamps)
        figures.append(stamps.ms_per_token())
    return statistics.median(figures)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--shape", default=None, help="a model shape with random weights instead (e.g. llama-3.1-8b)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--kv", nargs="+", default=["dense", "quest:0.1"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.shape:
        from .common import random_model

        model = random_model(args.shape, device=device)
    else:
        model = load_model(args.model)[0].to(device=device, dtype=dtype)
    ids = torch.randint(1, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    n = args.new_tokens
    rows = []
    for spec in args.kv:
        def kv():
            return None if spec == "dense" else parse_kv(spec)

        row = {"kv": spec, "device": device, "context": args.context, "new_tokens": n}
        dec = Decoder(model, kv=kv())
        row["decoder_eager_ms"] = time_path(lambda s: dec.generate(ids, n, streamer=s, eos_token_id=[]), args.reps)
        if device == "cuda":
            dec = Decoder(model, kv=kv()).compile()
            dec.generate(ids, n, eos_token_id=[])  # compile and capture outside the timing
            row["decoder_compiled_ms"] = time_path(lambda s: dec.generate(ids, n, streamer=s, eos_token_id=[]), args.reps)
        dec.detach()
        with policyzoo.apply(model, kv=kv()):
            row["hf_generate_ms"] = time_path(
                lambda s: model.generate(ids, max_new_tokens=n, streamer=s, do_sample=False, eos_token_id=None, pad_token_id=0),
                args.reps,
            )
        rows.append(row)
    cols = [c for c in ("decoder_eager_ms", "decoder_compiled_ms", "hf_generate_ms") if c in rows[0]]
    print(f"| kv | {' | '.join(cols)} | hf / fastest Decoder |")
    print("|---|" + "---:|" * (len(cols) + 1))
    for r in rows:
        fastest = min(r[c] for c in cols if c.startswith("decoder"))
        print(f"| {r['kv']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + f" | {r['hf_generate_ms'] / fastest:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if device == "cuda" else None}, f, indent=1)


if __name__ == "__main__":
    main()
