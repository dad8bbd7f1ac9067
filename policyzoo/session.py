"""`DecodeSession`: the one owner of a Decoder's decode state.

A session holds the paged KV cache, the per-layer policy states, the step context, the sampler
state and the setting (``dense``, ``proj``, ``kv``, ``both``), and it is the only code that drives
the wrapped model through a decode: `prefill` fills the cache from a prompt, `step` decodes one token
per row, `audit` records what the policy changes. `Decoder.generate`, the evaluation runner,
`policyzoo.eval.compare`, gate calibration and the benchmarks all decode through it::

    session = dec.session
    logits = session.prefill(input_ids, capacity=input_ids.shape[1] + 64)
    token = session.choose(logits[:, -1])           # greedy unless `sample` said otherwise
    for _ in range(63):
        logits = session.step(token)                # or session.step(): feed the token it chose
        token = session.last_token

The step is one function of the session's device tensors, so it compiles once per shape key
(`Decoder.compile`; `compiled.CompiledSteps`: each key's step has a code object of its own, so the
compiled code of one Decoder never crowds out another's) and, on CUDA, is captured in a CUDA graph
that the session replays directly.
"""

from __future__ import annotations

import dataclasses
import math
import types
import weakref
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from . import _compat, inductor_compat
from .attention import ATTN_IMPLEMENTATION
from .bytes import SETTINGS
from .cache import PagedKVCache
from .kv.base import KVSelector, KVState, check_count
from .kv.context import ContextStore
from .compiled import WARMUP_STEPS, CompiledSteps, own_code
from .regional import RegionalStep, call_layer
from .offload import Offload
from .runtime import Recorder, Runtime
from .sampling import Sampler, is_token
from .timing import time_ms

# Prompt tokens (rows x positions) one prefill forward takes at most: a longer unpadded prompt is
# prefilled in chunks, so its activations stay a few GB (one forward over 16 rows of 32K tokens
# would hold 60 GB of MLP activations on an 8B model).
PREFILL_TOKENS = 65536


class DecodeSession:
    """Decode state and the steps that advance it, for one wrapped model (see the module docstring).

    Built by `Decoder`; reach it as ``decoder.session``. Args: the wrapped ``model``, the shared
    ``runtime`` the model's hooks read, the Decoder's KV policy (``kv``, or None) and whether it has
    a projection sparsifier (``proj``), the ``dense`` stand-in policy, and the cache layout.
    """

    def __init__(
        self,
        model: nn.Module,
        runtime: Runtime,
        *,
        kv: KVSelector | None,
        proj: bool,
        dense: KVSelector,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        offload: Offload | None = None,
    ) -> None:
        self.model, self.runtime, self.kv, self.has_proj, self._dense = model, runtime, kv, proj, dense
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self.num_heads, self.num_kv_heads, self.head_dim = _compat.head_dims(model)
        self.num_layers = len(_compat.decoder_layers(model))
        self.offload = offload
        self.host_layers = offload.host_layers(self.num_layers) if offload is not None else frozenset()
        self.vocab_size = _compat.output_size(model)
        self.setting = ("both" if proj else "kv") if kv is not None else ("proj" if proj else "dense")
        self.sampler: Sampler | None = None
        self.contexts: ContextStore | None = None
        self.last_token: Tensor | None = None  # the tokens the last step (or `choose`) chose, [B]
        self._tokens: Tensor | None = None  # [B, 1]: what the next step feeds
        self._compiled: CompiledSteps | None = None  # None: eager steps
        self._dynamic_capacity = False
        self._graph_state: tuple = ()  # `policy_state_layout` when the graphs were recorded
        self._room = 0  # steps the cache has room for (kept on the host: checking the device would sync)
        runtime.owner = weakref.ref(self)

    # ------------------------------------------------------------------------------ setting
    def available_settings(self) -> tuple[str, ...]:
        """``dense`` always, ``proj`` with a projection sparsifier, ``kv`` with a KV policy, ``both``
        with both."""
        have = {"dense": True, "proj": self.has_proj, "kv": self.kv is not None}
        have["both"] = have["proj"] and have["kv"]
        return tuple(s for s in SETTINGS if have[s])

    def use(self, setting: str) -> "DecodeSession":
        """Decode from the next prefill on with ``setting``: ``dense`` (every KV page, dense
        projections), ``proj`` (sparse projections only), ``kv`` (the KV policy only) or ``both``."""
        if setting not in self.available_settings():
            raise ValueError(f"setting must be one of {', '.join(self.available_settings())} for this Decoder, got {setting!r}")
        self.runtime.policy = self.kv if setting in ("kv", "both") else self._dense
        self.runtime.sparse_proj = setting in ("proj", "both")
        self.setting = setting
        return self

    # ------------------------------------------------------------------------------ compile
    def compile(
        self,
        mode: str | None = None,
        dynamic_capacity: bool = False,
        cuda_graphs: bool | None = None,
        backend: str = "inductor",
        regional: bool = False,
    ) -> None:
        """Compile the step with ``torch.compile`` (see `Decoder.compile`): the whole step, or with
        ``regional`` one decoder layer that serves every layer (`regional.RegionalStep`)."""
        cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a model on a CUDA device")
        if cuda_graphs and mode in ("reduce-overhead", "max-autotune"):
            raise ValueError(f"mode={mode!r} records CUDA graphs itself; pass cuda_graphs=False with it")
        self._dynamic_capacity = dynamic_capacity
        if backend == "inductor":
            inductor_compat.apply()
        if dynamic_capacity:
            # Inductor's rewrite of a scatter into a zero tensor as a pointwise select gave `SSA` a
            # wrong selection with symbolic sizes (a sampled page lost on caches of up to 8 pages;
            # aot_eager and this build match eager). `options` replaces `mode`: same settings.
            modal = torch._inductor.list_mode_options(mode) if mode else {}
            options = {**modal, "optimize_scatter_upon_const_tensor": False} if backend == "inductor" else None
            compile_fn = partial(torch.compile, backend=backend, options=options, dynamic=None)
            if self.runtime.cache is not None:
                _mark_capacity_dynamic(self.runtime.cache)
        else:
            compile_fn = partial(torch.compile, backend=backend, mode=mode, dynamic=False)

        def build(label: str) -> Any:
            if regional:
                return RegionalStep(self.model, self.runtime, self._decode_step, compile_fn(own_code(call_layer, label)))
            return compile_fn(types.MethodType(own_code(DecodeSession._decode_step, label), self))

        name = type(self.kv).__name__ if self.kv is not None else "Dense"
        self._compiled = CompiledSteps(build, name=name, cuda_graphs=cuda_graphs, dynamic_capacity=dynamic_capacity, regional=regional)

    @property
    def compiled(self) -> bool:
        """Whether steps run a compiled function (audited steps still run eagerly)."""
        return self._compiled is not None

    @property
    def compiled_steps(self) -> CompiledSteps | None:
        """The compiled steps, one per key (`compiled.CompiledSteps`), or None when steps run eagerly."""
        return self._compiled

    def step_key(self) -> tuple:
        """What tells this sequence batch's compiled step apart from others: the setting, the sampling
        mode and, for a fixed capacity, the cache's batch and capacity (a dynamic capacity's step serves
        them all)."""
        cache = self.runtime.cache
        mode = self.sampler.mode
        sampling = ("nucleus" if mode.nucleus else "sample") if mode.do_sample else "greedy"
        if self._dynamic_capacity:
            return (self.setting, sampling)
        return (self.setting, sampling, f"b{cache.batch}", f"n{cache.capacity}")

    # ------------------------------------------------------------------------------ cache
    @property
    def cache(self) -> PagedKVCache | None:
        return self.runtime.cache

    def reserve(self, batch: int, capacity: int, *, exact: bool = False) -> PagedKVCache:
        """A cache for ``batch`` rows of ``capacity`` tokens (rounded up to whole pages): the current
        one when it fits (``exact``: only when it has exactly that capacity: the kernels' grids follow
        the capacity, so a benchmark must not time a larger cache), else a new one. A new cache frees
        the old one first and drops the CUDA graphs recorded on it."""
        self._need_active()
        for name, value in (("batch", batch), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        capacity = math.ceil(capacity / self.page_size) * self.page_size
        cache = self.runtime.cache
        if cache is not None and cache.batch == batch and (cache.capacity == capacity if exact else cache.capacity >= capacity):
            return cache
        self.release()
        cache = PagedKVCache(
            self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity,
            page_size=self.page_size, dtype=self.dtype, device=self.device, summaries=self._summaries(),
            host_layers=self.host_layers, cache_slots=self.offload.cache_slots(capacity // self.page_size) if self.offload else 0,
            prefetch=bool(self.offload and self.offload.prefetch),
        )  # fmt: skip
        if self._dynamic_capacity:
            _mark_capacity_dynamic(cache)
        self.contexts = ContextStore(self.num_layers, self.device)
        self.runtime.cache, self.runtime.contexts = cache, self.contexts
        scale = self.head_dim**-0.5
        self.runtime.states = [KVState(cache, layer, scale, contexts=self.contexts) for layer in range(self.num_layers)]
        self.sampler = Sampler(batch, self.vocab_size, self.device)
        self._tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        if self.device.type == "cuda":
            torch._dynamo.mark_static_address(self._tokens)
        return cache

    def retire(self) -> None:
        """Free everything this session holds, compiled steps included: a later Decoder took its model
        over, so it will never decode again (`_need_active` refuses it)."""
        self.release()
        self._compiled = None

    def release(self) -> None:
        """Free the cache and everything made for it (its CUDA graphs, step context, sampler)."""
        self.runtime.cache, self.runtime.states, self.runtime.contexts = None, [], None
        self.contexts = self.sampler = self._tokens = self.last_token = None
        if self._compiled is not None:
            self._compiled.drop_graphs()

    def _summaries(self) -> tuple[str, ...]:
        """The page summaries the cache keeps: those the KV policy reads (`KVSelector.summaries`).
        Every setting decodes with that policy or with `Dense`, which reads none."""
        return tuple(self.kv.summaries) if self.kv is not None else ()

    def _begin(self, batch: int, capacity: int, start: Tensor, length: int, exact: bool = False) -> PagedKVCache:
        """A new sequence batch: rows own slots ``start[b] .. length-1``; the policy's per-layer
        stores and the step context start empty."""
        cache = self.reserve(batch, capacity, exact=exact)
        for state in self.runtime.states:
            state.store.clear()
        cache.reset(start, length)
        self._room = cache.capacity - length
        parts = self.runtime.policy.step_context
        self.contexts.keep_previous = "previous" in parts
        self.contexts.keep_hidden = "hidden" in parts
        self.contexts.keep_rotary = "rotary" in parts
        self.contexts.reset(self.runtime.policy.new_request())
        self.sampler.configure()
        return cache

    # ------------------------------------------------------------------------------ prefill
    def check_inputs(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(input_ids int64[B, T], attention_mask int64[B, T])`` checked: integer ids on the
        model's device, a 0/1 left-padded mask (all ones when None) with a real token in every row."""
        if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.long, torch.int32):
            raise TypeError("input_ids must be an integer tensor of shape [batch, tokens]")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must have shape [batch, tokens] with batch, tokens >= 1, got {tuple(input_ids.shape)}")
        if input_ids.device != self.device:
            raise ValueError(f"input_ids are on {input_ids.device} but the model is on {self.device}")
        input_ids = input_ids.long()
        low, high = int(input_ids.min()), int(input_ids.max())  # one host read per request
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"input_ids must be token ids in 0..{self.vocab_size - 1}, got {low if low < 0 else high}")
        if attention_mask is None:
            return input_ids, torch.ones_like(input_ids)
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask shape {shape} != input_ids shape {tuple(input_ids.shape)}")
        mask = attention_mask.to(input_ids.device).long()
        if bool(((mask != 0) & (mask != 1)).any()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError("attention_mask must be 0/1 and left-padded (zeros before the ones in every row)")
        if bool((mask[:, -1] == 0).any()):
            raise ValueError("attention_mask: every row needs at least one real token")
        return input_ids, mask

    @torch.no_grad()
    def prefill(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, capacity: int | None = None, keep_logits: int = 1
    ) -> Tensor:
        """Start a sequence batch from a (left-padded) prompt: a dense forward fills the cache.

        ``capacity`` is the tokens per row the cache must hold (prompt plus new tokens; default the
        prompt). Returns the logits of the last ``keep_logits`` prompt positions, ``[B, keep, V]``.
        """
        input_ids, mask = self.check_inputs(input_ids, attention_mask)
        b, t = input_ids.shape
        if capacity is not None:
            check_count(capacity, "capacity", minimum=1)
            if capacity < t:
                raise ValueError(f"capacity ({capacity}) must hold the prompt's {t} tokens (and the tokens to decode after it)")
        _compat.check_positions(self.model, max(capacity or t, t), "capacity (prompt + tokens to decode)")
        check_count(keep_logits, "keep_logits", minimum=1)
        if keep_logits > t:
            raise ValueError(f"keep_logits ({keep_logits}) must be at most the prompt's {t} tokens")
        start = (mask == 0).sum(1)
        base = self.prompt_slot(t)
        cache = self._begin(b, max(capacity or t, t) + base, start + base, t + base)
        positions = (torch.arange(t, device=input_ids.device)[None, :] - start[:, None]).clamp(min=0)
        padded = bool(start.any())
        chunk = self._prefill_chunk(b, t, keep_logits, padded)
        runtime = self.runtime
        runtime.prompt_slot, runtime.prefill_padded = base, padded
        try:
            with self._phase("prefill"):
                for first in range(0, t, chunk):
                    last = min(t, first + chunk)
                    cache.length.fill_(base + last)  # what the chunk's summaries and the policy see
                    runtime.prefill_offset, runtime.prefill_last = first, last == t
                    out = self.model(
                        input_ids=input_ids[:, first:last], position_ids=positions[:, first:last], use_cache=False,
                        logits_to_keep=keep_logits if last == t else 1,
                    )  # fmt: skip
                self.runtime.policy.finish_prefill(self.runtime.states)
            self._drop_graphs_of_old_state()
        finally:
            runtime.prompt_slot, runtime.prefill_padded, runtime.prefill_offset, runtime.prefill_last = 0, True, 0, True
        return out.logits

    def prompt_slot(self, t: int) -> int:
        """The cache slot of position 0 of a ``t``-token prompt: the prompt is placed to end on a
        page boundary. Rows of a batch share slot numbers, so a row's first real token sits at the
        prompt's end minus its length; with the end on a boundary, where that token falls in its
        page depends on the row's own length only. A row's pages, their summaries and what a page
        policy selects are then the same in any batch as when the row runs alone. A policy that
        groups pages into blocks (`KVSelector.slot_alignment`) has the prompt end on a block boundary."""
        align = math.lcm(self.page_size, self.runtime.policy.slot_alignment or 1)
        return -t % align

    def _prefill_chunk(self, batch: int, t: int, keep_logits: int, padded: bool) -> int:
        """Prompt positions per prefill forward: all of them, unless the prompt is longer than
        `PREFILL_TOKENS` allows and chunks can serve it (no padding, softmax attention, a policy
        without a prefill of its own, whose hook would see one chunk only)."""
        chunk = max(self.page_size, PREFILL_TOKENS // batch // self.page_size * self.page_size)
        policy = self.runtime.policy
        whole = (
            t <= chunk or padded or keep_logits > t - (t - 1) // chunk * chunk
            or self.runtime.attention != "softmax" or policy.own_prefill
        )  # fmt: skip
        return t if whole else chunk

    def needs_own_prefill(self) -> bool:
        """Whether the policy in use builds state in a prefill of its own (`KVSelector.prefill`, or
        the previous step's selection it reads), so that `load_prefix` cannot start it."""
        policy = self.runtime.policy
        return policy.own_prefill or "previous" in policy.step_context

    @torch.no_grad()
    def load_prefix(self, prefix: list[tuple[Tensor, Tensor]], start: Tensor, *, capacity: int) -> None:
        """Start a sequence batch from keys and values computed elsewhere (a dense prefill shared by
        several settings): ``prefix`` holds per layer ``(k, v) [B, H_kv, T, D]``, left-padded, with
        row ``b``'s first real token at ``start[b]``. The cache then holds what `prefill` of the same
        prompt would have written, where `prefill` writes it (from slot `prompt_slot`)."""
        if self.needs_own_prefill():
            raise ValueError(f"{type(self.runtime.policy).__name__} builds state in its own prefill: call prefill()")
        if len(prefix) != self.num_layers:
            raise ValueError(f"prefix has {len(prefix)} layers, the model {self.num_layers}")
        b, _, t, _ = prefix[0][0].shape
        base = self.prompt_slot(t)
        cache = self._begin(b, max(capacity, t) + base, start.to(self.device) + base, t + base)
        for layer, (k, v) in enumerate(prefix):
            cache.write_prefill(layer, k.to(cache.dtype), v.to(cache.dtype), base)

    @torch.no_grad()
    def fill_random(self, n: int, *, batch: int = 1, capacity: int | None = None, generator: torch.Generator | None = None) -> None:
        """Start a sequence batch of ``n`` random keys and values per row, summaries included, for
        timing (speed does not depend on the values at a fixed budget): a cache of exactly
        ``capacity`` tokens (default ``n + 64``), no prompt. A policy that builds state in its own
        prefill gets it from random queries."""
        capacity = capacity if capacity is not None else n + 64
        if capacity < n:
            raise ValueError(f"capacity ({capacity}) must hold the {n} filled tokens")
        cache = self._begin(batch, capacity, torch.zeros(batch, dtype=torch.long, device=self.device), n, exact=True)
        q_shape = (batch, self.num_heads, n, self.head_dim)
        policy = self.runtime.policy
        for layer, state in enumerate(self.runtime.states):
            cache.keys[layer][:, :, :n].normal_(generator=generator)
            cache.values[layer][:, :, :n].normal_(generator=generator)
            cache.summarise(layer, slice(0, math.ceil(n / cache.page_size)))
            if self.needs_own_prefill():
                # Drawn in the model's dtype: a float32 draw and its copy would be 24 GiB at 1M tokens (8B shape).
                q = torch.randn(q_shape, generator=generator, device=self.device, dtype=self.dtype)
                policy.prefill(state, q, cache.keys[layer][:, :, :n], cache.values[layer][:, :, :n])
                if self.contexts.keep_previous:
                    policy.finish_prefill([state])
                    self.contexts.seed_previous(layer, policy.select(state, q[:, :, -1]))
        if self.needs_own_prefill():
            policy.finish_prefill(self.runtime.states)
        self._drop_graphs_of_old_state()

    def rewind(self, length: int) -> None:
        """Set every row's length back to ``length`` tokens (a benchmark times the same slot again)."""
        self._need_cache()
        self.runtime.cache.rewind(length)
        self._room = self.runtime.cache.capacity - length

    def time_step(self, *, calls: int = 8, reps: int = 3, warmup: int = 2, rewind: bool = True) -> float:
        """Milliseconds per decode step at the current context, the step as `generate` runs it
        (compiled and replayed when the session is compiled), by the shared timer
        (`timing.time_ms`: CUDA events on CUDA): the median over ``reps`` of ``calls`` steps, every
        rep from the current length, or with ``rewind=False`` each rep going on from the last (the
        context grows by the steps taken; offload's page caches then see consecutive steps, as in
        generation, not the same steps again). A compiled session first takes the steps that
        compile and capture it."""
        self._need_cache()
        cache = self.runtime.cache
        length = int(cache.length)
        if self.compiled:
            warmup = max(warmup, WARMUP_STEPS + 1)
        steps = max(calls, warmup) if rewind else warmup + calls * reps
        if length + steps > cache.capacity:
            raise ValueError(f"the cache holds {cache.capacity} tokens: no room for {steps} steps after {length}")
        setup = (lambda: self.rewind(length)) if rewind else None
        return time_ms(self.step, calls=calls, reps=reps, warmup=warmup, setup=setup, device=self.device)

    # ------------------------------------------------------------------------------ steps
    def sample(
        self,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_token_id: int | list[int] = (),  # type: ignore[assignment]
        pad_token_id: int = 0,
        generator: torch.Generator | None = None,
    ) -> None:
        """How this sequence batch chooses its tokens (`sampling.Sampler`): greedy by default. Rows
        that choose an ``eos_token_id`` (an id or a list of ids) are finished and get ``pad_token_id`` from then on."""
        self._need_cache()
        eos = [eos_token_id] if is_token(eos_token_id) else eos_token_id
        self.sampler.configure(do_sample=do_sample, temperature=temperature, top_p=top_p, eos=eos, pad=pad_token_id, generator=generator)

    @torch.no_grad()
    def choose(self, logits: Tensor) -> Tensor:
        """The next tokens ``int64[B]`` from ``logits [B, V]`` (the prefill's last position) by the
        sequence batch's sampling rule; the next `step` feeds them."""
        self._need_cache()
        if not isinstance(logits, Tensor) or logits.shape != (self._tokens.shape[0], self.vocab_size):
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"logits must be a tensor [batch, vocab] = {(self._tokens.shape[0], self.vocab_size)}, got {shape}")
        self.sampler.draw()
        self.last_token = self._choose_and_feed(logits)
        return self.last_token

    @torch.no_grad()
    def step(self, tokens: Tensor | None = None) -> Tensor:
        """Decode one token per row and return the next-token logits ``[B, V]``.

        ``tokens`` (``[B]`` or ``[B, 1]``) are fed; None feeds what the last step or `choose` chose
        (finished rows: the pad id). The step then chooses the next tokens itself (`last_token`). On
        a compiled session this is the compiled step, replayed as a CUDA graph on CUDA; with an audit
        on, the eager step. A CUDA graph's outputs are overwritten by the next step: copy what must
        outlive it.
        """
        self._need_cache()
        if self._room <= 0:
            raise RuntimeError(f"the cache is full ({self.runtime.cache.capacity} tokens a row): start the sequence batch "
                               "with a larger capacity (prefill(..., capacity=prompt + tokens to decode))")
        if tokens is not None:
            if not isinstance(tokens, Tensor) or tokens.numel() != self._tokens.numel() or tokens.is_floating_point():
                shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
                raise ValueError(f"tokens must be an integer tensor of {self._tokens.shape[0]} token ids ([B] or [B, 1]), got {shape}")
            self._tokens.copy_(tokens.reshape(self._tokens.shape))
        self.sampler.draw()
        with self._phase("decode"):
            if self._compiled is None or self.runtime.audit is not None:
                logits, token = self._decode_step()
            else:
                logits, token = self._compiled(self.step_key())
        self.last_token = token
        self._room -= 1
        return logits

    @torch.no_grad()
    def redo_dense(self, tokens: Tensor) -> Tensor:
        """Decode ``tokens`` (the last step's, ``[B]`` or ``[B, 1]``) again at the last step's slot,
        densely (every page, dense projections) and uncompiled; their keys and values replace the
        step's. Returns the dense logits ``[B, V]`` (the reference pass of `policyzoo.eval.compare`)."""
        self._need_cache()
        self._tokens.copy_(tokens.reshape(self._tokens.shape))
        with self._phase("dense_decode"):
            return self._forward()

    @contextmanager
    def audit(self, recorder: Recorder | None = None) -> Iterator[Recorder]:
        """Record every step in the block with ``recorder`` (a new `policyzoo.eval.audit.Audit` by
        default): dropped mass, output error, kept fractions. Audited steps run eagerly."""
        if recorder is None:
            from .eval.audit import Audit

            recorder = Audit()
        previous, self.runtime.audit = self.runtime.audit, recorder
        try:
            yield recorder
        finally:
            self.runtime.audit = previous

    # ------------------------------------------------------------------------------ internals
    def _need_cache(self) -> None:
        self._need_active()
        if self.runtime.cache is None:
            raise RuntimeError("no sequence batch: call prefill(), load_prefix() or fill_random() first")

    def _need_active(self) -> None:
        if not self.runtime.active:
            raise RuntimeError(
                "this Decoder no longer drives its model: a Decoder built later on the same model took it over. "
                "Use the newer Decoder, or wrap a copy of the model (copy.deepcopy) to decode with two side by side"
            )

    @contextmanager
    def _phase(self, phase: str) -> Iterator[None]:
        self.runtime.phase = phase  # type: ignore[assignment]
        try:
            with _compat.attn_implementation(self.model, ATTN_IMPLEMENTATION):
                yield
        finally:
            self.runtime.phase = "idle"

    def _forward(self) -> Tensor:
        """The model on ``_tokens`` at slot ``length - 1``; its RoPE position is the token's index
        among its row's real tokens."""
        cache = self.runtime.cache
        positions = (cache.length - 1 - cache.start).clamp(min=0)[:, None]
        logits = self.model(input_ids=self._tokens, position_ids=positions, use_cache=False, logits_to_keep=1).logits[:, -1]
        self.contexts.end_step()
        return logits

    def _decode_step(self) -> tuple[Tensor, Tensor]:
        """The compiled unit: advance the cache (every layer writes at the new ``length - 1``),
        run the model, choose the next tokens and feed them to the next step. Only device tensors
        change, in place."""
        self.runtime.cache.length += 1
        logits = self._forward()
        self.contexts.advance()
        return logits, self._choose_and_feed(logits)

    def _choose_and_feed(self, logits: Tensor) -> Tensor:
        """The next tokens by the sampling rule, written where the next step reads its input."""
        token = self.sampler.choose(logits)
        self._tokens.copy_(token[:, None])
        return token

    def _drop_graphs_of_old_state(self) -> None:
        """After a prefill: a recorded CUDA graph reads the policy's tensors at the addresses they had
        when it was recorded, so where the new request's policy made new ones (a store remade in
        prefill), the graphs are recorded again (and the compiled step warmed up again)."""
        layout = policy_state_layout(self.runtime)
        if layout != self._graph_state:
            if self._compiled is not None:
                self._compiled.drop_graphs()
            self._graph_state = layout


def policy_state_layout(runtime: Runtime) -> tuple:
    """Where the policy's per-request tensors live: ``(address, shape, dtype)`` of every tensor in the
    layers' stores and the policy's request state (nested dicts, lists, tuples and dataclass fields
    included), in a fixed order. Equal for two requests exactly when a graph recorded on one reads
    the other's."""
    out: list = []

    def visit(value: object) -> None:
        if isinstance(value, Tensor):
            out.append((value.data_ptr(), tuple(value.shape), value.dtype))
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                visit(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name))

    visit([state.store for state in runtime.states])
    visit(runtime.contexts.request if runtime.contexts is not None else None)
    return tuple(out)


def _mark_capacity_dynamic(cache: PagedKVCache) -> None:
    # maybe_: a value the code specialises on recompiles instead of raising.
    for t in cache.tensors():
        if t.dim() == 4:  # keys/values [B, H_kv, capacity, D], summaries [B, H_kv, pages, D]
            torch._dynamo.maybe_mark_dynamic(t, 2)
