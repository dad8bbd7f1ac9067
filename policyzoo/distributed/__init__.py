"""Tensor-parallel decoding over the ranks of a `torch.distributed` process group (issue 21).

`shard(model)` splits every decoder layer of a loaded model across the ranks of a process group, in
place, in the layout of gpt-fast's ``tp.py``:

- **attention:** each rank keeps ``H_kv / world`` KV heads and their GQA groups of query heads: the
  rows of ``q_proj``, ``k_proj`` and ``v_proj`` that make them (column-parallel) and the matching
  columns of ``o_proj`` (row-parallel);
- **MLP:** each rank keeps ``d_ff / world`` channels: rows of ``gate_proj`` and ``up_proj``, columns
  of ``down_proj``;
- one all-reduce (sum) after the attention's output projection and one after the MLP's, as
  functional collectives (`torch.distributed._functional_collectives`), which ``torch.compile``
  traces; a row-parallel bias is kept on rank 0 only, so the sum adds it once;
- embeddings, norms and the LM head are replicated: every rank computes the same logits and, greedy
  (or sampling from identically seeded generators), chooses the same token.

The model's config then describes one rank's shard (its head counts and ``intermediate_size``), so a
`policyzoo.Decoder` built on the sharded model gives each rank a cache of its own KV heads, and a KV
policy selects on them with no communication. Launch one process per rank, e.g. with ``torchrun``
(``python -m policyzoo.distributed --help``, `policyzoo.distributed.__main__`)::

    torch.distributed.init_process_group("nccl")   # "gloo" on CPUs
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).to(device)
    shard(model)
    out = Decoder(model, kv=Quest(0.1)).generate(ids, 64, streamer=streamer if rank == 0 else None)

Projection sparsity works per shard. q/k/v and gate/up read the whole (replicated) input, so every
rank keeps the features one process keeps. ``o`` and ``down`` read this rank's shard of their input:
a sparsifier that declares ``shardable`` thresholds the shard at the whole input's threshold, found
with one small collective (`TopK`: the k-th largest magnitude over the ranks' shards, by an
all-gather of each shard's top k; fast `TopK`: the mean magnitude, by an all-reduce; `Threshold`'s
calibrated thresholds need none). Calibrate before sharding: a sharded model's inputs are shards.

Not supported yet: models whose q/k/v or gate/up are one fused linear.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _compat

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# The projections (`_compat.PROJECTIONS` names) whose input a rank holds a shard of.
ROW_PARALLEL = ("o", "down")


@dataclass(frozen=True)
class Shard:
    """What one rank holds (`shard` stores it as ``model.policyzoo_shard``): its ``rank`` of ``world``
    ranks in ``group``, the model's full head counts and MLP width, and its own slices of them."""

    rank: int
    world: int
    group: Any
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world

    @property
    def local_kv_heads(self) -> int:
        return self.num_kv_heads // self.world

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.world

    def own(self, size: int) -> slice:
        """This rank's slice of a dimension it holds ``size`` entries of (the world holds ``world·size``)."""
        return slice(self.rank * size, (self.rank + 1) * size)


def shard(model: nn.Module, group: dist.ProcessGroup | None = None) -> Shard:
    """Split ``model``'s decoder layers across the ranks of ``group`` (default: the whole world), in
    place, before the model is wrapped in a `policyzoo.Decoder` (see the module docstring). Every
    rank must hold the same full weights when it is called. Returns this rank's `Shard`."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard() needs torch.distributed initialised: call torch.distributed.init_process_group first (torchrun sets it up)")
    if shard_of(model) is not None:
        raise ValueError("the model is already sharded")
    _compat.check_supported(model)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    config = model.config
    h, h_kv, d = _compat.head_dims(model)
    ff = config.intermediate_size
    for name, total in (("attention heads", h), ("KV heads", h_kv), ("MLP channels (intermediate_size)", ff)):
        if total % world:
            raise ValueError(f"{total} {name} do not split over {world} ranks")
    for i, layer in enumerate(_compat.decoder_layers(model)):
        missing = [n for n in ATTENTION if not isinstance(getattr(layer.self_attn, n, None), nn.Linear)]
        missing += [n for n in MLP if not isinstance(getattr(getattr(layer, "mlp", None), n, None), nn.Linear)]
        if missing:
            raise NotImplementedError(f"layer {i} has no separate linear {missing}: only models with separate q/k/v/o and gate/up/down projections shard")
    part = Shard(rank, world, group, h, h_kv, ff)
    heads, kv_heads, channels = part.own(part.local_heads * d), part.own(part.local_kv_heads * d), part.own(part.local_intermediate)
    for layer in _compat.decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        _keep_rows(attn, "q_proj", heads)
        _keep_rows(attn, "k_proj", kv_heads)
        _keep_rows(attn, "v_proj", kv_heads)
        _keep_columns(attn, "o_proj", heads, rank)
        _keep_rows(mlp, "gate_proj", channels)
        _keep_rows(mlp, "up_proj", channels)
        _keep_columns(mlp, "down_proj", channels, rank)
        for module in (attn, mlp):
            module.register_forward_hook(partial(_summed_over_ranks, part))
        for attr, value in (("num_heads", part.local_heads), ("num_key_value_heads", part.local_kv_heads)):
            if hasattr(attn, attr):  # older transformers keep the counts on the module
                setattr(attn, attr, value)
    # The config now describes this rank's shard; head_dim is pinned first, as it may be derived
    # from the head count.
    config.head_dim = d
    config.num_attention_heads, config.num_key_value_heads = part.local_heads, part.local_kv_heads
    config.intermediate_size = part.local_intermediate
    model.policyzoo_shard = part
    return part


def shard_of(model: nn.Module) -> Shard | None:
    """The `Shard` `shard` gave ``model``, or None for a model that is not sharded."""
    return getattr(model, "policyzoo_shard", None)


def _keep_rows(parent: nn.Module, name: str, rows: slice) -> None:
    """Column-parallel: keep output rows ``rows`` of ``parent.name`` (and of its bias)."""
    old: nn.Linear = getattr(parent, name)
    new = nn.Linear(old.in_features, rows.stop - rows.start, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight[rows])
        if old.bias is not None:
            new.bias.copy_(old.bias[rows])
    setattr(parent, name, new)


def _keep_columns(parent: nn.Module, name: str, columns: slice, rank: int) -> None:
    """Row-parallel: keep input columns ``columns`` of ``parent.name``; its bias on rank 0 only."""
    old: nn.Linear = getattr(parent, name)
    bias = old.bias is not None and rank == 0
    new = nn.Linear(columns.stop - columns.start, old.out_features, bias=bias, device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight[:, columns])
        if bias:
            new.bias.copy_(old.bias)
    setattr(parent, name, new)


def _summed_over_ranks(part: Shard, module: nn.Module, args: Any, output: Any) -> Any:
    """The forward hook of a row-parallel block: its output (the first element of the attention's
    ``(output, weights)``) summed over the ranks."""
    if isinstance(output, tuple):
        return (sum_over_ranks(output[0], part), *output[1:])
    return sum_over_ranks(output, part)


def is_row_parallel(part: Shard | None, name: str) -> bool:
    """Whether projection ``name`` (``"<layer>.<target>"``) reads a shard of its input on this rank."""
    return part is not None and part.world > 1 and name.rsplit(".", 1)[-1] in ROW_PARALLEL


def sum_over_ranks(x: Tensor, part: Shard) -> Tensor:
    """``x`` summed over ``part``'s ranks (a traceable all-reduce)."""
    funcol = _functional_collectives()
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", _group(part)))


def concat_over_ranks(x: Tensor, part: Shard) -> Tensor:
    """The ranks' ``x`` concatenated along the last dimension, in rank order (a traceable all-gather)."""
    funcol = _functional_collectives()
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), 0, _group(part)))  # [world·B, ..., n]
    return torch.cat(gathered.chunk(part.world, dim=0), dim=-1)


def _group(part: Shard) -> Any:
    return part.group if part.group is not None else dist.group.WORLD


def _functional_collectives() -> Any:
    """`torch.distributed._functional_collectives`, imported on first use (only builds with
    torch.distributed have it)."""
    import torch.distributed._functional_collectives as funcol

    return funcol
