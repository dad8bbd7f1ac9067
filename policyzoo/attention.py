"""The attention function policyzoo registers with transformers' `AttentionInterface`, and the
dense prefill attention it uses.

HF attention modules compute q, k, v (RoPE and Qwen3's q/k norms included) and hand them to the
registered function together with the keyword arguments of the model's forward. A policyzoo session
passes `ForwardArgs` among them (``policyzoo=...``): the function finds its layer's backend there
(`policyzoo.backend`), which writes k, v into the paged cache and attends, densely with SDPA during
prefill and through the KV policy's `Selection` during decode. A model with 1.5-entmax attention
attends with entmax in both (`prefill_attention_entmax15`, then the decode kernel's entmax mode).
The session selects this implementation only while it drives a forward, so the wrapped model stays
a plain HF model otherwise. No HF mask is built for it (the implementation has no mask function
registered): the cache knows each row's padding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

from . import kernels
from .forward import KWARG, ForwardArgs

ATTN_IMPLEMENTATION = "policyzoo"


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


# Query rows per block of the sliding-window prefill: a block's mask is ``[B, rows, rows + window - 1]``,
# so a long prompt never builds a ``[T, T]`` one.
WINDOW_PREFILL_ROWS = 1024


def window_mask(q_slots: Tensor, k_slots: Tensor, start: Tensor, window: int) -> Tensor:
    """``bool[B, Tq, Tk]``: the query at slot ``i`` of row ``b`` sees the key at slot ``j`` when
    ``start[b] <= j <= i`` and ``j > i - window`` (the model's sliding window: the last ``window``
    slots, its own included, as transformers' ``sliding_window_overlay``). A query of padding sees
    only itself, so no row is fully masked."""
    i, j = q_slots[:, None], k_slots[None, :]
    band = (j <= i) & (j > i - window)
    return (band[None] & (j[None] >= start[:, None, None])) | (j == i)[None]


def prefill_attention_window(
    q: Tensor, k: Tensor, v: Tensor, first: int, start: Tensor, window: int, scale: float, rows: int = WINDOW_PREFILL_ROWS
) -> Tensor:
    """Sliding-window causal SDPA of a prompt chunk: ``q [B, H, T, D]`` at slots ``first ..
    first+T-1``; ``k, v [B, H_kv, S, D]`` at the ``S >= T`` slots that end with the queries' own (a
    later chunk's keys are preceded by the window's earlier ones). ``start [B]``: each row's first
    real slot. ``rows`` queries at a time, each block over the keys its window reaches."""
    t, s = q.shape[2], k.shape[2]
    k_first = first + t - s
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    for i0 in range(0, t, rows):
        i1 = min(t, i0 + rows)
        lo, hi = max(0, first + i0 - window + 1 - k_first), first + i1 - k_first
        q_slots = torch.arange(first + i0, first + i1, device=q.device)
        k_slots = torch.arange(k_first + lo, k_first + hi, device=q.device)
        allowed = window_mask(q_slots, k_slots, start, window)
        out[:, :, i0:i1] = F.scaled_dot_product_attention(
            q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=allowed[:, None], scale=scale, enable_gqa=gqa
        )
    return out


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


def policyzoo_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention of one decoder layer in a forward a policyzoo session drives: the session passes
    `ForwardArgs` as the forward's ``policyzoo=`` keyword argument, and the layer's backend
    (`policyzoo.backend`) does the work: ``query [B, H, T, D]``, ``key, value [B, H_kv, T, D]`` →
    ``[B, T, H, D]``."""
    args = kwargs.get(KWARG)
    if not isinstance(args, ForwardArgs):
        raise RuntimeError(
            "attention implementation 'policyzoo' runs only inside a Decoder's generate or session steps, which pass "
            "the model's forward policyzoo=ForwardArgs(...); the model's config still names it (set "
            "model.config._attn_implementation back, e.g. to 'sdpa')"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    backend = args.backend(module)
    if args.phase == "prefill":  # checked once per request, eagerly: a compiled step reads no layer index
        check_layer_kind(backend, module, kwargs)
        return backend.prefill(args, query, key, value, scale).transpose(1, 2), None
    if query.shape[2] != 1:
        raise RuntimeError(f"decode expects one token per row, got {query.shape[2]}")
    return backend.decode(args, query[:, :, 0], key, value, scale).unsqueeze(1), None


def check_layer_kind(backend: Any, module: nn.Module, kwargs: dict) -> None:
    """Refuse a layer whose attention its backend would change, so nothing differs silently from the
    model's own: attention logit soft-capping (``softcap``; no kernel applies it), or a sliding window
    (``sliding_window``, which the model's attention module passes) that the backend does not apply:
    a window layer must have the model's window, a full layer only a window its cache never exceeds."""
    layer = getattr(module, "layer_idx", "?")  # for the messages
    if kwargs.get("softcap") is not None:
        raise RuntimeError(f"layer {layer}: attention logit soft-capping (softcap={kwargs['softcap']}) is not supported")
    declared, window = kwargs.get("sliding_window"), getattr(backend, "window", None)
    if window is not None and declared != window:
        raise RuntimeError(f"layer {layer}: the model attends with sliding_window={declared}, its backend with a window "
                           f"of {window} (policyzoo's layer kinds, _compat.layer_windows, disagree with the model)")
    if window is None and declared is not None and declared < backend.cache.capacity:
        raise RuntimeError(f"layer {layer}: the model attends with sliding_window={declared}, but its backend keeps the "
                           f"whole cache of {backend.cache.capacity} slots (policyzoo's layer kinds, "
                           "_compat.layer_windows, disagree with the model)")


def register() -> None:
    """Register `policyzoo_attention` with transformers' `AttentionInterface` under
    `ATTN_IMPLEMENTATION` (a Decoder does this when it wraps a model; registering again is harmless)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, policyzoo_attention)
