"""The one place that knows about Hugging Face model internals and version differences.

policyzoo drives HF models through public extension points only: a registered attention function
(`AttentionInterface.register`) and forward calls with ``use_cache=False`` (the library keeps its
own cache, so the ``past_key_values`` → ``cache`` rename between transformers 5.17 and 5.2x never
reaches it). Projection names map onto the standard Llama-family module names.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "olmo2")

# The layer kinds of a config's ``layer_types`` that policyzoo runs: whole-context attention, and the
# sliding window (each token attends to the last ``sliding_window`` positions, its own included).
LAYER_TYPES = ("full_attention", "sliding_attention")

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
    """Refuse a model policyzoo cannot decode exactly as the model's own attention does: an
    unsupported family (named, with the supported ones), a bare base model, or a supported family's
    config with an attention feature the kernels do not apply (`check_config`)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = "; for Gemma 3, load its text model (Gemma3ForCausalLM)" if model_type == "gemma3" else ""
        raise ValueError(
            f"model: unsupported architecture {model_type!r}; policyzoo supports {', '.join(SUPPORTED_MODEL_TYPES)}{hint}"
        )
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise ValueError("model must be a *ForCausalLM with .model.layers (got a bare base model?)")
    check_config(config)


def check_config(config: Any) -> None:
    """Refuse a supported family's config whose attention policyzoo would change: logit soft-capping
    (Gemma-2's ``attn_logit_softcapping``: the kernels apply none), bidirectional attention, or a layer
    kind other than full and sliding-window attention (`layer_windows` raises for it)."""
    get = _getter(config)
    model_type = get("model_type")
    if model_type == "gemma2" and get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"model: Gemma-2 with attn_logit_softcapping={get('attn_logit_softcapping')} is not supported: policyzoo's "
            "prefill and decode kernels apply no attention logit soft-capping, so decoding would differ from the "
            "model's own; Gemma-3 (gemma3_text) and Gemma-2 configs with attn_logit_softcapping=None are supported"
        )
    if get("use_bidirectional_attention"):
        raise ValueError(f"model: {model_type} with use_bidirectional_attention=True is not a causal LM policyzoo can decode")
    layer_windows(config)


def _getter(config: Any) -> Callable[..., Any]:
    """Read a field of an HF config object or of a config.json dict alike."""
    if isinstance(config, dict):
        return config.get
    return lambda name, default=None: getattr(config, name, default)


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each decoder layer's attention window in tokens, ``None`` where it attends to the whole
    context, as the model's attention modules apply it; ``config`` is an HF config or a config.json dict.

    ``layer_types`` where the config has them (Qwen2/Qwen3, Gemma-2/3 in transformers 5.x):
    ``"sliding_attention"`` layers get ``sliding_window``. Mistral passes ``sliding_window`` to every
    layer. A config without ``layer_types`` (a config.json) gets the defaults transformers derives:
    Qwen2/Qwen3 slide from layer ``max_window_layers`` on when ``use_sliding_window``, Gemma-2 every
    other layer from layer 0, Gemma-3 all but every ``sliding_window_pattern``-th (6th) layer."""
    get = _getter(config)
    n, model_type = int(get("num_hidden_layers")), get("model_type")
    window = get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not get("use_sliding_window", False):
        window = None  # transformers ignores sliding_window unless use_sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"model: sliding_window must be a positive int or None, got {window!r}")
    if model_type == "mistral":  # MistralAttention passes config.sliding_window to every layer
        return (window,) * n
    types = get("layer_types") or _default_layer_types(get, model_type, n, window)
    if len(types) != n:
        raise ValueError(f"model: layer_types names {len(types)} layers, the config has num_hidden_layers={n}")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"model: layer types {unknown} are not supported; policyzoo runs {', '.join(LAYER_TYPES)}")
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def _default_layer_types(get: Callable[..., Any], model_type: str, n: int, window: int | None) -> list[str]:
    """The ``layer_types`` transformers derives for a config that does not list them."""
    if window is None:
        return ["full_attention"] * n
    if model_type in ("qwen2", "qwen3"):
        first = int(get("max_window_layers", 28))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if model_type == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if model_type == "gemma3_text":
        pattern = int(get("sliding_window_pattern", 6))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def sliding_window(model: nn.Module) -> int | None:
    """The smallest attention window of the model's layers in tokens, or None when every layer
    attends to the whole context."""
    windows = [w for w in layer_windows(model.config) if w is not None]
    return min(windows) if windows else None


def attention_scale(model: nn.Module) -> float:
    """The softmax scale the model's attention applies (its modules' ``scaling``: ``head_dim**-0.5``
    for most families, ``query_pre_attn_scalar**-0.5`` for Gemma)."""
    scaling = getattr(attention_modules(model)[0], "scaling", None)
    return float(scaling) if isinstance(scaling, (int, float)) else head_dims(model)[2] ** -0.5


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
    if size is None and layers:  # a sliding layer holds min(window, max_cache_len): the largest is the request's
        sizes = [getattr(layer, "max_cache_len", None) for layer in layers]
        sizes = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool)]
        size = max(sizes) if sizes else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def static_cache_all_sliding(cache: object) -> bool:
    """Whether every layer of a Hugging Face static cache is a sliding-window layer, whose size is
    ``min(window, max_cache_len)``: its `static_cache_size` is then capped at the window."""
    layers = getattr(cache, "layers", None) or ()
    return bool(layers) and all(getattr(layer, "is_sliding", False) for layer in layers)


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
