"""One dense forward of the frozen model, keeping each layer's input hidden state, post-RoPE
queries and keys and the rotary embedding."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

from policyzoo import _compat

CAPTURE_ATTENTION = "policyzoo-forecast-capture"


@dataclass
class Capture:
    """The frozen model's internals on one chunk of ``T`` tokens (fp32, CPU)."""

    hidden: Tensor  # [L, T, d]: the hidden state entering each layer
    queries: Tensor  # [L, H, T, D]: after RoPE (and any q norm)
    keys: Tensor  # [L, H_kv, T, D]: after RoPE (and any k norm)
    rotary: tuple[Tensor, Tensor] | None  # (cos, sin) [T, D_rot]: what the layers receive
    scales: list[float]  # each layer's softmax scale


_STASH: list[dict] = []  # the records of the capture in progress (a stack: empty outside `capture`)


def capture_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[Tensor, None]:  # fmt: skip
    """An attention function (`AttentionInterface`) that keeps the layer's post-RoPE query and key
    and attends as SDPA does. The chunk is one unpadded causal sequence, so the causal flag is the
    whole mask (transformers builds none for an implementation it does not know)."""
    if not _STASH:
        raise RuntimeError(f"attention implementation {CAPTURE_ATTENTION!r} only runs inside recipes.forecast.capture.capture")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    _STASH[-1][module] = (query.detach(), key.detach(), scale)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2), None


AttentionInterface.register(CAPTURE_ATTENTION, capture_attention)


@torch.no_grad()
def capture(model: nn.Module, ids: Tensor) -> Capture:
    """Run the frozen model on ``ids [T]`` and keep, per layer, the hidden state entering it (a
    forward pre-hook), its queries and keys (`capture_attention`, selected only for this forward)
    and the rotary embedding the layers receive. Works for any model whose decoder layers take
    ``position_embeddings`` and whose attention calls the registered function (Llama, Mistral, Qwen)."""
    layers, attention = _compat.decoder_layers(model), _compat.attention_modules(model)
    n = len(layers)
    hidden: list[Tensor | None] = [None] * n
    rotary: list = [None]

    def enter(i: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        h = args[0] if args else kwargs["hidden_states"]
        hidden[i] = h[0].float().cpu()
        if i == 0 and kwargs.get("position_embeddings") is not None:
            cos, sin = kwargs["position_embeddings"]
            rotary[0] = (cos[0].float().cpu(), sin[0].float().cpu())

    hooks = [layer.register_forward_pre_hook(partial(enter, i), with_kwargs=True) for i, layer in enumerate(layers)]
    _STASH.append({})
    try:
        device = next(model.parameters()).device
        with _compat.attn_implementation(model, CAPTURE_ATTENTION):
            model(input_ids=ids[None].to(device), use_cache=False, logits_to_keep=1)
    finally:
        records = _STASH.pop()
        for hook in hooks:
            hook.remove()
    missing = [i for i, a in enumerate(attention) if a not in records]
    if missing or any(h is None for h in hidden):
        raise RuntimeError(f"capture: layers {missing or '?'} did not call the attention function (an unsupported model?)")
    queries = torch.stack([records[a][0][0].float().cpu() for a in attention])
    keys = torch.stack([records[a][1][0].float().cpu() for a in attention])
    return Capture(torch.stack(hidden), queries, keys, rotary[0], [float(records[a][2]) for a in attention])
