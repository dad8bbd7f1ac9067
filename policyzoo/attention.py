"""The attention function policyzoo registers with transformers' `AttentionInterface`.

HF attention modules compute q, k, v (RoPE and Qwen3's q/k norms included) and hand them to this
function; it writes k, v into the paged cache and attends: densely with SDPA during prefill, through
the KV policy's `Selection` during decode. The Decoder attaches ``module._policyzoo = (runtime,
layer)`` to each attention module and selects this implementation only while it decodes, so the
wrapped model stays a plain HF model otherwise. No HF mask is built for it (the implementation has
no mask function registered): the cache knows each row's padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

from . import kernels
from .cache import PagedKVCache
from .kv.base import KVSelector, KVState
from .kv.dense import Dense

if TYPE_CHECKING:
    from .eval.audit import Audit

ATTN_IMPLEMENTATION = "policyzoo"
_DENSE = Dense()


@dataclass
class Runtime:
    """Mutable decode state shared by the attention function and the projection wrappers.

    ``policy`` is the KV policy decode steps use and ``sparse_proj`` says whether the projection
    wrappers sparsify them: `Decoder.use` sets both per request (a gated Decoder picks ``dense``,
    ``proj``, ``kv`` or ``both``).
    """

    policy: KVSelector
    # "dense_decode" decodes with every page and dense projections (the reference pass of an audit)
    phase: Literal["idle", "prefill", "decode", "dense_decode"] = "idle"
    cache: PagedKVCache | None = None
    states: list[KVState] = field(default_factory=list)
    audit: "Audit | None" = None
    sparse_proj: bool = True


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, start: Tensor, scale: float) -> Tensor:
    """Causal SDPA over a left-padded prompt: query ``i`` of row ``b`` sees keys ``start[b]..i``.

    Query rows that are padding see only themselves, so no row is fully masked (no NaN).
    """
    t = q.shape[2]
    pos = torch.arange(t, device=q.device)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, None, :] >= start[:, None, None])
    allowed = allowed | torch.eye(t, dtype=torch.bool, device=q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def policyzoo_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    handle = getattr(module, "_policyzoo", None)
    if handle is None:
        raise RuntimeError("attention implementation 'policyzoo' is only usable through policyzoo.Decoder")
    runtime, layer = handle
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache, state = runtime.cache, runtime.states[layer]
    if runtime.phase == "prefill":
        cache.write_prefill(layer, key, value)
        out = prefill_attention(query, key, value, cache.start, scale)
        runtime.policy.prefill(state, query, key, value)
        return out.transpose(1, 2), None
    if query.shape[2] != 1:
        raise RuntimeError(f"decode expects one token per row, got {query.shape[2]}")
    cache.write(layer, key, value)
    policy = runtime.policy if runtime.phase == "decode" else _DENSE
    policy.append(state, key, value)
    q = query[:, :, 0]
    sel = policy.select(state, q)
    out, _ = kernels.decode_attention(q, state.keys, state.values, sel, cache.start, cache.length, scale)
    if runtime.audit is not None:
        runtime.audit.record_attention(layer, q, cache, sel, out, scale)
    return out.unsqueeze(1), None


AttentionInterface.register(ATTN_IMPLEMENTATION, policyzoo_attention)
