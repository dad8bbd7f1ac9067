"""Policies inside Hugging Face's own decoding: ``model.generate`` and ``pipeline("text-generation")``.

::

    with policyzoo.apply(model, kv=Quest(0.1), proj=TopK(0.5)):
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)

`apply` wraps the model as a `Decoder` would (its projection wrappers and its session) and adds two
hooks on the model: before each forward that ``generate`` runs, the session starts a request (the
prompt's forward) or a decode step (each later forward) and hands the forward its `ForwardArgs`, as
`Decoder.generate` does; after it, the session closes the prompt or the step. ``generate``'s own
loop does the rest: logits processors, sampling, stopping criteria, streamers. Its cache argument
becomes a `PolicyzooCache`, a shell that holds no keys or values (the session's paged cache does)
and reports how many tokens ``generate`` has fed. The greedy tokens are those of `Decoder.generate`.

The cache is sized per request: ``apply`` makes ``generate`` ask for a static cache, whose size is
the request's ``max_length``, and takes that size (``generation_config.cache_implementation`` is
set to ``"static"`` inside the block, and ``disable_compile`` to True: ``generate`` would otherwise
compile its forward around the hooks). ``apply(..., capacity=n)`` fixes it instead. Leaving the
block puts everything back: the projections, the attention implementation, the generation config
and the hooks.

This path is eager (uncompiled) and pays ``generate``'s own per-step host work; `Decoder.generate`
is the fast path (`docs/hf.md` gives figures).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _compat
from .attention import ATTN_IMPLEMENTATION
from .decoder import Decoder
from .forward import KWARG
from .kv.base import KVSelector, check_count
from .proj.base import ProjectionSparsifier
from .session import DecodeSession


class PolicyzooLayer(CacheLayerMixin):
    """One decoder layer's entry in a `PolicyzooCache`: its keys and values are written by the
    attention function into the session's paged cache, so `update` hands them through unchanged."""

    is_compileable = False
    is_sliding = False

    def __init__(self, shell: "PolicyzooCache") -> None:
        super().__init__()
        self.shell = shell
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor, *args: Any) -> None:
        return None

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return key_states, value_states

    def get_seq_length(self, *args: Any) -> int:
        return self.shell.seen

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.shell.seen, 0  # not read: the policyzoo attention builds no mask

    def get_max_length(self) -> int:
        return self.shell.capacity

    def get_max_cache_shape(self) -> int:
        return self.shell.capacity


class PolicyzooCache(Cache):
    """The cache ``generate`` carries inside `apply`: it counts the tokens fed (``seen``, what
    ``generate`` reads as the sequence length) for a session that holds the keys and values."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.seen = 0
        self.capacity = capacity
        super().__init__(layers=[PolicyzooLayer(self) for _ in range(num_layers)])

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return False


class _Hooks:
    """The two model hooks of `apply`: they turn each forward ``generate`` runs into a prompt forward
    or a decode step of ``session``."""

    def __init__(self, session: DecodeSession, capacity: int | None) -> None:
        self.session, self.capacity = session, capacity
        self.closing: str | None = None  # "prompt" or "step": what the running forward must close

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get(KWARG) is not None:  # a forward the session runs itself (Decoder.generate)
            return None
        session = self.session
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError("policyzoo.apply: decode from input_ids (inputs_embeds are not supported)")
        name = _compat.cache_kwarg(module, kwargs)
        shell = kwargs.get(name)
        if isinstance(shell, PolicyzooCache):
            if input_ids.shape[1] != 1:
                raise ValueError(
                    f"policyzoo.apply decodes one token per row and step after the prompt, got {input_ids.shape[1]} "
                    "(generate's prefill_chunk_size, assisted decoding and prompt lookup are not supported)"
                )
            forward = session.open_step()
            session.switch.sparse = session.sparse_proj
            kwargs["position_ids"], self.closing = session.token_positions(), "step"
            shell.seen += 1
        else:
            capacity = self._capacity(shell, input_ids)
            prompt = session.open_prompt(input_ids, _padding(kwargs, input_ids), capacity=capacity, chunks=False)
            forward = session.prompt_args(prompt, 0, prompt.length)
            shell = PolicyzooCache(session.num_layers, capacity)
            shell.seen = prompt.length
            kwargs[name], kwargs["position_ids"], self.closing = shell, prompt.positions, "prompt"
        kwargs.pop("input_ids", None)
        kwargs.update({"input_ids": input_ids, "use_cache": True, KWARG: forward})
        return (), kwargs

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        closing, self.closing = self.closing, None
        if closing == "prompt":
            self.session.close_prompt()
        elif closing == "step":
            self.session.switch.sparse = False
            self.session.close_step()

    def _capacity(self, cache: object, input_ids: Tensor) -> int:
        """The tokens per row the request's cache holds: ``apply``'s ``capacity``, else the size of
        the static cache ``generate`` made for the request (its ``max_length``)."""
        if self.capacity is not None:
            return self.capacity
        size = _compat.static_cache_size(cache)
        if size is None:
            raise ValueError(
                "policyzoo.apply sizes its cache from generate's static cache (generation_config.cache_implementation="
                f"'static'), but this call made a {type(cache).__name__}: leave cache_implementation unset, or give "
                "policyzoo.apply(..., capacity=<prompt + new tokens>)"
            )
        window = _compat.sliding_window(self.session.model)
        if _compat.static_cache_all_sliding(cache) and window is not None and size >= window:
            # Every layer slides (Mistral): the static cache holds min(window, max_length), so max_length
            # is unknown. Each layer keeps a ring of its window whatever the capacity, so the model's
            # position limit serves as the capacity: no full-length tensor is made for it.
            limit = _compat.max_positions(self.session.model)
            if limit is None:
                raise ValueError("policyzoo.apply: generate's static cache of a model whose every layer slides holds only "
                                 "its window; give policyzoo.apply(..., capacity=<prompt + new tokens>)")
            size = max(size, limit)
        return max(size, input_ids.shape[1])


def _padding(kwargs: dict, input_ids: Tensor) -> Tensor | None:
    """The prompt's 0/1 padding mask ``[B, T]``: the forward's 2-D attention mask where ``generate``
    passed one; where it passed masks it prepared itself (a static cache's), the count of real tokens
    in each row, read off the RoPE position of the row's last token (``generate`` numbers a row's
    real tokens from 0, whatever it gives its padding)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2:
        return mask
    positions = kwargs.get("position_ids")
    if positions is None:
        return None
    t = input_ids.shape[1]
    real = positions[:, -1:].long() + 1
    return (torch.arange(t, device=input_ids.device)[None, :] >= t - real).long()


@contextmanager
def apply(
    model: nn.Module,
    kv: KVSelector | None = None,
    proj: ProjectionSparsifier | None = None,
    *,
    page_size: int | None = None,
    capacity: int | None = None,
) -> Iterator[Decoder]:
    """Decode with ``kv`` and ``proj`` inside Hugging Face's ``model.generate`` (and so
    ``pipeline("text-generation")``) within the block; yields the `Decoder` that holds the session
    (its ``session`` and ``last_audit`` are usable as usual). ``capacity``: the tokens per row every
    request's cache holds (default: each request's ``max_length``). See the module docstring."""
    if capacity is not None:
        check_count(capacity, "capacity", minimum=1)
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        raise RuntimeError("policyzoo.apply: the model is already inside a policyzoo.apply block (they do not nest)")
    dec = Decoder(model, kv=kv, proj=proj, page_size=page_size)
    hooks = _Hooks(dec.session, capacity)
    handles = [
        model.register_forward_pre_hook(hooks.before, with_kwargs=True),
        model.register_forward_hook(hooks.after, with_kwargs=True, always_call=True),
    ]
    config, generation = model.config, model.generation_config
    saved = (config._attn_implementation, generation.cache_implementation, getattr(generation, "disable_compile", False))
    config._attn_implementation = ATTN_IMPLEMENTATION
    generation.cache_implementation, generation.disable_compile = "static", True
    try:
        yield dec
    finally:
        for handle in handles:
            handle.remove()
        config._attn_implementation, generation.cache_implementation, generation.disable_compile = saved
        dec.detach()


__all__ = ["PolicyzooCache", "apply"]
