"""Tensor-parallel decode speed (`policyzoo.distributed`): `Decoder.generate` end to end on each
rank of a random-weight model of a built-in shape, beside the compiled step alone, against one rank's
byte floor (`ByteAccount.per_rank`: a 1/world share of the projections and KV, the LM head whole).

Run one process per GPU; compare TP=1 and TP=N runs of the same settings made in one session::

    torchrun --nproc-per-node 1 -m benchmarks.tp --shape llama-3.1-8b --context 32768 --settings dense,quest0.1 --out DIR/tp1
    torchrun --nproc-per-node 2 -m benchmarks.tp --shape llama-3.1-8b --context 32768 --settings dense,quest0.1 --out DIR/tp2
    torchrun --nproc-per-node 4 -m benchmarks.tp --shape llama-3.1-70b --context 32768 --settings dense,quest0.1 --out DIR/tp4

Each rank builds only its shard: the model is made on the meta device, sharded, then given random
weights on its GPU (the same draws on every rank, so the replicated embeddings and LM head agree and
every rank chooses the same token). Rank 0 writes ``sweep.json`` and ``sweep.md``. On CPUs (gloo, a
``--tiny`` model) it is a smoke test of the script, and its times mean nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from pathlib import Path

import torch
import torch.distributed as dist

from policyzoo.bytes import BUILTIN, ByteAccount
from policyzoo.distributed import shard

from . import common, e2e
from .sweep import copy_bandwidth


def sharded_random_model(shape: str, device: torch.device, layers: int | None = None, tiny: bool = False):
    """This rank's shard of a random Llama-architecture model of ``shape`` (`common.random_config`),
    built on the meta device, sharded, and filled on ``device``: normal(0, 0.02) matrices,
    unit norms."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = common.random_config(shape, layers, tiny)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    part = shard(model)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02, generator=g)
    with torch.device(device):  # its buffers were made on the meta device
        model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
    model.generation_config.eos_token_id = None
    return model.eval(), part


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(BUILTIN))
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--settings", default="dense,quest0.1", help="benchmark settings (`common.settings`), KV only")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=None, help="fewer layers for a quick check (floors use the shape's)")
    p.add_argument("--tiny", action="store_true", help="a toy model of the same structure (CPU smoke test)")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend (the CPU smoke test: aot_eager)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/tp"))
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    try:
        model, part = sharded_random_model(args.shape, device, args.layers, args.tiny)
        acct = ByteAccount.from_config(args.shape).per_rank(world)
        bw = copy_bandwidth() if cuda else float("nan")
        for name in args.settings.split(","):
            kv_f, proj_f, r_p, r_kv = common.settings()[name]
            if proj_f is not None:
                raise ValueError(f"{name}: projection settings need calibration on the whole model; time KV settings here")
            dec = common.decoder(model, name).compile(backend=args.backend)
            got = e2e.measure(dec, 1, args.context, args.new_tokens)
            floor = acct.floor_ms(args.context, bw, r_p, r_kv, r_select=common.selection_ratio(name))
            row = {"section": "tp", "setting": name, "shape": args.shape, "context": args.context, "world": world, **got,
                   "floor_ms": floor, "ms/floor": got["generate_ms"] / floor, "bound_vs_tp1": ByteAccount.from_config(args.shape).step_bytes(args.context, r_p, r_kv) / acct.step_bytes(args.context, r_p, r_kv)}
            rows.append(row)
            if rank == 0:
                print(f"tp={world} {args.shape} n={args.context} {name:<12} generate {got['generate_ms']:.3f} ms/token, step {got['step_ms']:.3f} ms; "
                      f"floor {floor:.3f} ms (one rank's bytes)", flush=True)
            dec = None
            common.free_memory()
    finally:
        if rank == 0:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            meta = {"gpu": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu", "gpus": world,
                    "date": dt.date.today().isoformat(), "torch": torch.__version__, "shape": args.shape,
                    "source": common.source_digest(), "bandwidth_TBps": bw / 1e12 if cuda else None}
            (out / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            keys = ["setting", "world", "context", "generate_ms", "step_ms", "generate/step", "floor_ms", "ms/floor", "bound_vs_tp1"]
            lines = [f"# tensor parallel, {meta['gpu']} x{world}, {meta['date']}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |" for r in rows]
            (out / "sweep.md").write_text("\n".join(lines) + "\n")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
