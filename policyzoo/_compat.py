"""The one place that knows about Hugging Face model internals and version differences.

policyzoo drives HF models through public extension points only: a registered attention function
(`AttentionInterface.register`) and forward calls with ``use_cache=False`` (the library keeps its
own cache, so the ``past_key_values`` → ``cache`` rename between transformers 5.17 and 5.2x never
reaches it). Projection names map onto the standard Llama-family module names.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Iterator

from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# short projection name -> (sub-module of a decoder layer, linear name)
PROJECTIONS = {
    "q": ("self_attn", "q_proj"),
    "k": ("self_attn", "k_proj"),
    "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"),
    "gate": ("mlp", "gate_proj"),
    "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}

# Projections that read the very same input tensor in every supported architecture (the attention
# module feeds one normed hidden state to q, k and v; the MLP one to gate and up).
SHARED_INPUT = (("q", "k", "v"), ("gate", "up"))


def check_supported(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model: unsupported architecture {model_type!r}; policyzoo supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise ValueError("model must be a *ForCausalLM with .model.layers (got a bare base model?)")


def sliding_window(model: nn.Module) -> int | None:
    """The model's attention window in tokens, or None when it attends to the whole context."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return window


def max_positions(model: nn.Module) -> int | None:
    """The most positions the model was made for (``config.max_position_embeddings``), or None where
    its config does not say. RoPE scaling (Llama 3.1's ``rope_scaling``) is already counted in it."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_positions(model: nn.Module, tokens: int, what: str) -> None:
    """Refuse a request whose ``tokens`` positions (``what`` they are, for the message) exceed the
    model's `max_positions`: its rotary embedding was not trained there, so its output would be
    garbage, silently."""
    limit = max_positions(model)
    if limit is not None and tokens > limit:
        raise ValueError(
            f"{what} = {tokens} tokens exceeds the model's max_position_embeddings ({limit}): shorten the prompt "
            "or max_new_tokens, or use a model made for longer contexts"
        )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def attention_modules(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in decoder_layers(model)]


def offloaded_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters that are not in memory: ``meta`` placeholders, which accelerate's
    offloading hooks (a ``device_map`` with ``"cpu"`` or ``"disk"`` entries) fill only inside their
    own module's forward."""
    return [name for name, p in model.named_parameters() if p.device.type == "meta"]


def output_size(model: nn.Module) -> int:
    """Entries of the model's logits: its LM head's outputs (the config's vocabulary size when the
    head is not a plain linear)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return int(getattr(head, "out_features", None) or model.config.vocab_size)


def head_dims(model: nn.Module) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)``."""
    c = model.config
    h = c.num_attention_heads
    return h, getattr(c, "num_key_value_heads", None) or h, getattr(c, "head_dim", None) or c.hidden_size // h


def cache_kwarg(model: nn.Module, kwargs: dict) -> str:
    """The name under which a forward receives its cache: ``cache`` since transformers 5.2x,
    ``past_key_values`` before (the name this call used, else the one the model's forward takes)."""
    for name in ("cache", "past_key_values"):
        if name in kwargs:
            return name
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def static_cache_size(cache: object) -> int | None:
    """The tokens per row a Hugging Face static cache was made for (``max_cache_len``), or None for
    any other cache."""
    size = getattr(cache, "max_cache_len", None)
    layers = getattr(cache, "layers", None)
    if size is None and layers:
        size = getattr(layers[0], "max_cache_len", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


@contextmanager
def attn_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """Select attention implementation ``name`` (registered with `AttentionInterface`) for a while.

    Setting the config attribute directly, rather than `set_attn_implementation`, skips HF's check
    against its own list of implementations; sub-configs follow through the config's setter.
    """
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous
