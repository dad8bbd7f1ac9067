"""``torchrun --nproc-per-node N -m policyzoo.distributed``: tensor-parallel decoding from the command
line (see `policyzoo.distributed`)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import TextStreamer

from ..assets import DEFAULT_MODEL, load_model, load_tokenizer
from ..decoder import Decoder
from ..spec import parse_kv, parse_proj
from . import shard


def main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node N -m policyzoo.distributed ...``: load a model on every rank,
    shard it, decode a prompt with each ``--kv`` and ``--proj`` setting; rank 0 streams the text (prints the ids
    with ``--ids``; or, with
    ``--out``, saves the new token ids and logits of every setting, and the graph breaks a compile
    met, with `torch.save`)."""

    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m policyzoo.distributed", description=main.__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Hub name or local path (default: the embedded model)")
    parser.add_argument("--prompt", default="The capital of France is", help="prompt text")
    parser.add_argument("--ids", default="", help="prompt token ids, comma-separated (instead of --prompt; no tokenizer is loaded)")
    parser.add_argument("--kv", nargs="+", default=["dense"], help="KV policy specs")
    parser.add_argument("--proj", nargs="+", default=["none"], help="projection sparsifier specs; every --kv with every --proj is decoded")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--compile", action="store_true", help="compile each rank's decode step (CUDA graphs on GPUs)")
    parser.add_argument("--out", default="", help="rank 0 saves {'results': {'KV+PROJ': (new ids, logits)}, 'graph_breaks': n} here")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank = dist.get_rank()
        dtype = getattr(torch, args.dtype)
        if args.ids:
            from transformers import AutoModelForCausalLM

            model, tokenizer = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval(), None
            ids = torch.tensor([[int(t) for t in args.ids.split(",")]])
        else:
            model, _ = load_model(args.model, dtype=dtype)
            tokenizer = load_tokenizer(args.model)
            ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        model.to(device)
        part = shard(model)
        if rank == 0:
            print(f"{part.world} ranks: {part.local_heads}/{part.num_heads} heads, {part.local_kv_heads}/{part.num_kv_heads} KV heads "
                  f"and {part.local_intermediate}/{part.intermediate_size} MLP channels each", flush=True)
        results = {}
        for spec in (f"{kv}+{proj}" for kv in args.kv for proj in args.proj):
            kv, proj = spec.split("+")
            dec = Decoder(model, kv=parse_kv(kv), proj=parse_proj(proj))
            if args.compile:
                dec.compile()
            streamer = None
            if rank == 0:
                print(f"[{spec}]", end=" ", flush=True)
                streamer = TextStreamer(tokenizer, skip_prompt=True) if tokenizer is not None else None
            out, logits = dec.generate(ids.to(device), args.new_tokens, eos_token_id=[], output_logits=True, streamer=streamer)
            new = out[0, ids.shape[1] :].cpu()
            results[spec] = (new, logits[0].cpu())
            if rank == 0 and tokenizer is None:
                print(" ".join(map(str, new.tolist())), flush=True)
        if rank == 0 and args.out:
            from torch._dynamo.utils import counters

            torch.save({"results": results, "graph_breaks": sum(counters["graph_break"].values())}, args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
