"""The attention function policyzoo registers with transformers' `AttentionInterface`.

HF attention modules compute q, k, v (RoPE and Qwen3's q/k norms included) and hand them to this
function; it writes k, v into the paged cache and attends: densely with SDPA during prefill, through
the KV policy's `Selection` during decode. A model with 1.5-entmax attention (its KV policy says
``attention="entmax"``, `Runtime.attention`) attends with entmax in both: `prefill_attention_entmax15`,
then the decode kernel's entmax mode (`kernels.decode_attention_entmax15`). The Decoder attaches
``module._policyzoo = (runtime, layer)`` to each attention module and selects this implementation
only while it decodes, so the wrapped model stays a plain HF model otherwise. No HF mask is built
for it (the implementation has no mask function registered): the cache knows each row's padding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

from . import kernels
from .kv.base import KVSelector, KVState
from .kv.dense import Dense
from .selection import Selection

ATTN_IMPLEMENTATION = "policyzoo"
_DENSE = Dense()


def prefill_mask(start: Tensor, t: int) -> Tensor:
    """``bool[B, T, T]``: query ``i`` of row ``b`` sees keys ``start[b]..i`` (causal, left padding).

    Query rows that are padding see only themselves, so no row is fully masked (no NaN).
    """
    pos = torch.arange(t, device=start.device)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, None, :] >= start[:, None, None])
    return allowed | torch.eye(t, dtype=torch.bool, device=start.device)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, start: Tensor, scale: float, padded: bool = True) -> Tensor:
    """Causal SDPA over a left-padded prompt (`prefill_mask`); ``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]``.

    A batch without padding (``padded=False``, which the caller knows from the attention mask)
    attends with SDPA's own causal mask instead: no ``[B, T, T]`` mask is made (17 GB for a 128K
    prompt), and the flash kernel can run; the keys and values are repeated for each query head of
    their group, since not every SDPA kernel takes grouped heads."""
    gqa = q.shape[1] != k.shape[1]
    if not padded:
        if gqa:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    allowed = prefill_mask(start, q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=gqa)


def prefill_attention_chunk(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal SDPA of the last ``q.shape[2]`` positions of an unpadded prompt over all its keys so
    far (``k, v [B, H_kv, end, D]``): query ``i`` sees keys up to ``end - T + i`` (the causal mask
    aligned to the bottom right, which SDPA's flash and memory-efficient kernels take without a
    materialised mask)."""
    from torch.nn.attention.bias import causal_lower_right

    if q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)


def entmax15(z: Tensor) -> Tensor:
    """1.5-entmax along the last dim of logits ``z`` (``-inf`` = masked): ``p = max(0, z/2 − τ)²``.

    ``τ`` is the exact sort-based `reference.entmax15_threshold`, so these are the weights of the
    decode kernel's entmax mode (and of the ``entmax`` package's ``entmax15``). A row without a finite
    logit gets all zeros.
    """
    x = z * 0.5
    tau = kernels.reference.entmax15_threshold(x)
    return torch.where(x > tau, (x - tau) ** 2, 0.0)


# Query rows per block of the entmax prefill: the scores of a block are ``[B, H, rows, T]`` (plus the
# threshold's float64 sort of them), so blocks bound the memory of long prompts.
ENTMAX_PREFILL_ROWS = 512


def prefill_attention_entmax15(
    q: Tensor, k: Tensor, v: Tensor, start: Tensor, scale: float, rows: int = ENTMAX_PREFILL_ROWS
) -> Tensor:
    """`prefill_attention` with 1.5-entmax weights: the same mask, ``p = entmax15(scale·q·kᵀ)``, ``p @ v``.

    ``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]`` (each KV head serves its group of ``H // H_kv``
    query heads, without copying the keys). There is no fused entmax SDPA, so the scores are
    materialised, ``rows`` query rows at a time, in fp32.
    """
    b, h, t, d = q.shape
    h_kv = k.shape[1]
    qg = q.float().reshape(b, h_kv, h // h_kv, t, d)
    kf, vf = k.float(), v.float()
    allowed = prefill_mask(start, t)[:, None, None]  # [B, 1, 1, T, T]
    out = torch.empty_like(qg)
    for i in range(0, t, rows):
        z = torch.einsum("bkgtd,bksd->bkgts", qg[:, :, :, i : i + rows], kf) * scale
        p = entmax15(z.masked_fill(~allowed[..., i : i + rows, :], -torch.inf))
        out[:, :, :, i : i + rows] = torch.einsum("bkgts,bksd->bkgtd", p, vf)
    return out.view(b, h, t, d).to(q.dtype)


def fetched_ahead(runtime: Any, policy: KVSelector, layer: int) -> bool:
    """Whether layer ``layer``'s page cache is filled by the layer below during a decode step (the
    policy makes its selection there, `KVSelector.predicts_layer`): the fork and the join of the
    prefetch both decide by this, so they always pair."""
    cache = runtime.cache
    return (runtime.phase == "decode" and cache.prefetch and cache.page_cache(layer) is not None
            and policy.predicts_layer(layer))


def prefetch_next_layer(runtime: Any, layer: int, policy: KVSelector, state: KVState, sel: Selection) -> None:
    """Start fetching the next layer's pages where they are fetched ahead (`fetched_ahead`): on a
    side stream, while this layer attends and runs its MLP (`offload.PageCache.prefetch`)."""
    if not fetched_ahead(runtime, policy, layer + 1):
        return
    cache = runtime.cache
    nxt = policy.next_layer_selection(state, sel)
    if nxt is None:
        raise RuntimeError(f"{type(policy).__name__}.predicts_layer({layer + 1}) is true, but next_layer_selection "
                           f"gave no selection at layer {layer}")
    if nxt.block % cache.page_size == 0:
        nxt = nxt.split(cache.page_size)
        cache.page_cache(layer + 1).prefetch(nxt, cache.keys[layer + 1], cache.values[layer + 1], cache.length)


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
    if runtime.phase == "idle":
        raise RuntimeError(
            "attention implementation 'policyzoo' runs only inside a Decoder's generate or session steps; "
            "the model's config still names it (set model.config._attn_implementation back, e.g. to 'sdpa')"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache, state = runtime.cache, runtime.states[layer]
    entmax = runtime.attention == "entmax"
    if runtime.phase == "prefill":
        base, offset = runtime.prompt_slot, runtime.prefill_offset
        cache.write_prefill(layer, key, value, base + offset)
        if offset:  # a later chunk of an unpadded prompt: it attends to the chunks before it too
            end = base + offset + query.shape[2]
            out = prefill_attention_chunk(query, state.keys[:, :, base:end], state.values[:, :, base:end], scale)
        elif entmax:
            out = prefill_attention_entmax15(query, key, value, cache.start - base, scale)
        else:
            out = prefill_attention(query, key, value, cache.start - base, scale, runtime.prefill_padded)
        runtime.policy.prefill(state, query, key, value)
        if runtime.prefill_last and runtime.contexts.keep_previous:  # step 0's "previous": the prompt's last token's
            runtime.policy.finish_prefill([state])
            runtime.contexts.seed_previous(layer, runtime.policy.select(state, query[:, :, -1]))
        return out.transpose(1, 2), None
    if query.shape[2] != 1:
        raise RuntimeError(f"decode expects one token per row, got {query.shape[2]}")
    cache.write(layer, key, value)
    policy = runtime.policy if runtime.phase == "decode" else _DENSE
    policy.append(state, key, value)
    q = query[:, :, 0]
    sel = policy.select(state, q)
    if runtime.phase == "decode":  # a dense reference pass leaves the policy's record alone
        runtime.contexts.record(layer, sel)
    attend = kernels.decode_attention_entmax15 if entmax else kernels.decode_attention
    page_cache = cache.page_cache(layer)
    # An offloaded layer's page selection goes through its page cache; a dense pass (every page) and a
    # token selection read the host in place.
    if page_cache is not None and sel.block % cache.page_size == 0 and not isinstance(policy, Dense):
        if fetched_ahead(runtime, policy, layer):
            page_cache.wait_for_prefetch(q)
        sel = sel.split(cache.page_size)
        slots = page_cache.stage(sel, state.keys, state.values, cache.length)
        prefetch_next_layer(runtime, layer, policy, state, sel)  # after this layer's fetch: they would share the link
        out, _ = attend(q, page_cache.keys, page_cache.values, sel, cache.start, cache.length, scale, slots)
    else:
        prefetch_next_layer(runtime, layer, policy, state, sel)
        out, _ = attend(q, state.keys, state.values, sel, cache.start, cache.length, scale)
    if runtime.audit is not None:
        runtime.audit.record_attention(layer, q, cache, sel, out, scale, attention=runtime.attention)
    return out.unsqueeze(1), None


AttentionInterface.register(ATTN_IMPLEMENTATION, policyzoo_attention)
