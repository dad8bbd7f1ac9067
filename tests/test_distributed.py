"""Contract of `policyzoo.distributed` (issue 21): a model sharded over two gloo ranks decodes the
tokens one process decodes (dense and Quest, each alone and with exact TopK, fast TopK and
Threshold; eager and compiled, its collectives traced with no graph break), and bad uses say what is
wrong."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from tiny_models import tiny_model

from policyzoo import Decoder, Quest, Threshold, TopK
from policyzoo.proj.base import ProjectionSparsifier
from policyzoo.distributed import shard, shard_of
from policyzoo.spec import parse_kv, parse_proj

PROMPT = [5, 9, 11, 100, 3, 17, 42, 8, 99, 1] + list(range(2, 40))
KV = ["dense", "quest:0.3,page=4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """The tiny model's directory, and the projection specs to decode it with (fast TopK's ratios and
    Threshold's thresholds calibrated on the whole model, before sharding, and saved beside it)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    model = tiny_model("llama", layers=2)
    model.save_pretrained(path)
    texts = [torch.randint(1, 128, (64,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    ratios = TopK(0.5, mode="fast").calibrate(model, texts).save(path / "ratios.safetensors")
    thresholds = Threshold(0.5).calibrate(model, texts).save(path / "thresholds.safetensors")
    return path, ["none", "topk:0.5", f"topk:mode=fast,path={ratios}", f"threshold:path={thresholds}"]


def one_process(path, spec, new_tokens=12):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    kv, proj = spec.split("+")
    dec = Decoder(model, kv=parse_kv(kv), proj=parse_proj(proj))
    out, logits = dec.generate(torch.tensor([PROMPT]), new_tokens, eos_token_id=[], output_logits=True)
    return out[0, len(PROMPT) :], logits[0]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_ranks_decode_what_one_process_decodes(saved_model, tmp_path, compiled):
    saved_model, projs = saved_model
    # Compiled: Quest with the exact TopK and with Threshold (compiles are slow on CPU). Their steps hold
    # every all-reduce of a step without a sparsifier; the fast TopK differs from Threshold only in
    # where its thresholds come from.
    kvs = KV[1:] if compiled else KV
    if compiled:
        projs = [p for p in projs if p != "none" and "mode=fast" not in p]
    out = tmp_path / "tp.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "policyzoo.distributed", "--model", str(saved_model),
           "--ids", ",".join(map(str, PROMPT)), "--kv", *kvs, "--proj", *projs, "--new-tokens", "12", "--out", str(out)]
    if compiled:
        cmd.append("--compile")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 ranks: 2/4 heads, 1/2 KV heads and 48/96 MLP channels each" in run.stdout
    saved = torch.load(out)
    if compiled:
        assert saved["graph_breaks"] == 0  # the all-reduces are traced into the step
    for spec in (f"{kv}+{proj}" for kv in kvs for proj in projs):
        tokens, logits = saved["results"][spec]
        want_tokens, want_logits = one_process(saved_model, spec)
        assert torch.equal(tokens, want_tokens), spec
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


@pytest.fixture
def one_rank_group():
    """A process group of this process alone (gloo), torn down afterwards."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_shards_into_the_whole_model(one_rank_group):
    model = tiny_model("llama", layers=2)
    ids = torch.tensor([PROMPT])
    want = Decoder(tiny_model("llama", layers=2), kv=Quest(0.3, page=4)).generate(ids, 8, eos_token_id=[])
    part = shard(model)
    assert shard_of(model) is part and (part.rank, part.world) == (0, 1)
    assert (part.local_heads, part.local_kv_heads) == (model.config.num_attention_heads, model.config.num_key_value_heads)
    assert torch.equal(Decoder(model, kv=Quest(0.3, page=4)).generate(ids, 8, eos_token_id=[]), want)


def test_bad_uses_say_what_is_wrong(one_rank_group, monkeypatch):
    model = tiny_model("llama", layers=2)
    shard(model)
    with pytest.raises(ValueError, match="already sharded"):
        shard(model)
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        Decoder(model, proj=Unshardable())
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)  # 4 heads, 2 KV heads: no split in 3
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        shard(tiny_model("llama", layers=2))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    halved = tiny_model("llama", layers=2)
    shard(halved)  # as rank 0 of 2: o and down now read shards of their inputs
    with pytest.raises(ValueError, match="before sharding"):
        Threshold(0.5).calibrate(halved, [torch.tensor(PROMPT)])


class Unshardable(ProjectionSparsifier):
    """A sparsifier that does not say it handles input shards."""

    keep, targets = 0.5, ("down",)

    def keep_mask(self, name, x):
        return x.abs() > 0


def test_sharding_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard(tiny_model("llama", layers=2))
