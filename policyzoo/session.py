"""`DecodeSession`: the decode loop, and the one owner of a Decoder's decode state.

A session holds the paged KV cache, one backend per decoder layer (`policyzoo.backend`), the step
context, the sampler and the setting (``dense``, ``proj``, ``kv``, ``both``), and it is the only
code that drives the wrapped model through a decode. Every forward it runs carries `ForwardArgs`
(``policyzoo=...``) down to the registered attention function: the phase, the policy and the
backends, nothing else. `Decoder.generate`, the evaluation runner, `policyzoo.eval.compare`, gate
calibration and the benchmarks all decode through it::

    session = dec.session
    logits = session.prefill(input_ids, capacity=input_ids.shape[1] + 64)
    token = session.choose(logits[:, -1])           # greedy unless `sample` said otherwise
    for _ in range(63):
        logits = session.step(token)                # or session.step(): feed the token it chose
        token = session.last_token

The step is one function of the session's device tensors, so it compiles once per shape key and,
on CUDA, is captured in a CUDA graph that the session replays (`policyzoo.compiled`).
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn

from . import _compat, kernels
from .attention import ATTN_IMPLEMENTATION
from .backend import Attention, Audited, Backend, Recorder, build_backends
from .bytes import SETTINGS
from .cache import PagedKVCache
from .compiled import CompiledSteps, compile_steps, mark_capacity_dynamic, mark_selection_dynamic, policy_state_layout
from .forward import KWARG, ForwardArgs, Phase, PromptChunk
from .kv.base import KVSelector, check_count
from .kv.context import ContextStore
from .offload import Offload
from .proj.base import ProjectionSwitch
from .sampling import Sampler, is_token
from .workers import Workers

# Prompt tokens (rows x positions) one prefill forward takes at most: a longer unpadded prompt is
# prefilled in chunks, so its activations stay a few GB (one forward over 16 rows of 32K tokens
# would hold 60 GB of MLP activations on an 8B model).
PREFILL_TOKENS = 65536


@dataclass(frozen=True)
class Prompt:
    """A prompt a session is prefilling (`DecodeSession.open_prompt`): its checked ids and RoPE
    positions ``[B, T]``, the cache slot of its position 0, whether any row is padded, and the
    positions one forward takes (`chunk`)."""

    input_ids: Tensor
    positions: Tensor
    slot: int
    padded: bool
    chunk: int

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


class DecodeSession:
    """Decode state and the steps that advance it, for one wrapped model (see the module docstring).

    Built by `Decoder`; reach it as ``decoder.session``. Args: the wrapped ``model``, the Decoder's
    KV policy (``kv``, or None) and whether it has a projection sparsifier (``proj``), the ``dense``
    stand-in policy, the projection wrappers' ``switch``, the model's ``attention``, the cache layout
    and the kernels' ``workspace``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        kv: KVSelector | None,
        proj: bool,
        dense: KVSelector,
        switch: ProjectionSwitch,
        attention: Attention,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        offload: Offload | None = None,
        workspace: kernels.Workspace | None = None,
    ) -> None:
        self.model, self.kv, self.has_proj, self._dense = model, kv, proj, dense
        self.switch, self.attention, self.workspace = switch, attention, workspace
        self.workers = Workers()  # processes for a policy's CPU work, started when first asked for
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self.num_heads, self.num_kv_heads, self.head_dim = _compat.head_dims(model)
        self.num_layers = len(_compat.decoder_layers(model))
        self.layer_windows = _compat.layer_windows(model.config)  # per layer: its sliding window, or None
        self.scale = _compat.attention_scale(model)  # what the policies score with: the model's own
        self.offload = offload
        self.host_layers = offload.host_layers(self.num_layers) if offload is not None else frozenset()
        self.vocab_size = _compat.output_size(model)
        self.policy: KVSelector = kv if kv is not None else dense  # the policy decode steps use (`use`)
        self.sparse_proj = proj  # whether decode steps run sparse projections (`use`)
        self.setting = ("both" if proj else "kv") if kv is not None else ("proj" if proj else "dense")
        self.active = True  # False once a later Decoder took the model over (`retire`)
        self.cache: PagedKVCache | None = None
        self.backends: tuple[Backend, ...] = ()
        self.contexts: ContextStore | None = None
        self.sampler: Sampler | None = None
        self.last_token: Tensor | None = None  # the tokens the last step (or `choose`) chose, [B]
        self._tokens: Tensor | None = None  # [B, 1]: what the next step feeds
        self._decode_args: ForwardArgs | None = None
        self._layer_views: list[ForwardArgs] | None = None
        self._recorder: Recorder | None = None
        self._compiled: CompiledSteps | None = None  # None: eager steps
        self._dynamic_capacity = False
        self._graph_state: tuple = ()  # `policy_state_layout` when the graphs were recorded
        self._room = 0  # steps the cache has room for (kept on the host: checking the device would sync)

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
        self.policy = self.kv if setting in ("kv", "both") else self._dense
        self.sparse_proj = setting in ("proj", "both")
        self.setting = setting
        self._decode_args = self._layer_views = None
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
        if dynamic_capacity and self.cache is not None:
            mark_capacity_dynamic(self.cache)
        name = type(self.kv).__name__ if self.kv is not None else "Dense"
        self._compiled = compile_steps(
            self._decode_step, self.model, self._layer_args if regional else None, name=name, mode=mode,
            dynamic_capacity=dynamic_capacity, cuda_graphs=cuda_graphs, backend=backend,
        )  # fmt: skip

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
        mode = self.sampler.mode
        sampling = ("nucleus" if mode.nucleus else "sample") if mode.do_sample else "greedy"
        if self._dynamic_capacity:
            return (self.setting, sampling)
        return (self.setting, sampling, f"b{self.cache.batch}", f"n{self.cache.capacity}")

    # ------------------------------------------------------------------------------ cache
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
        cache = self.cache
        if cache is not None and cache.batch == batch and (cache.capacity == capacity if exact else cache.capacity >= capacity):
            return cache
        self.release()
        offload = self.offload
        windows = self.windows_for(capacity)
        if self.kv is not None and len(windows) == self.num_layers:
            warnings.warn(f"every layer of the model is a sliding-window layer for a cache of {capacity} tokens (its window "
                          f"is {min(windows.values())}): {type(self.kv).__name__} runs on none of them", stacklevel=3)
        cache = PagedKVCache(
            self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity,
            page_size=self.page_size, dtype=self.dtype, device=self.device, summaries=self._summaries(),
            host_layers=self.host_layers, cache_slots=offload.cache_slots(capacity // self.page_size) if offload else 0,
            prefetch=bool(offload and offload.prefetch), windows=windows,
        )  # fmt: skip
        if self._dynamic_capacity:
            mark_capacity_dynamic(cache)
        self.cache, self.contexts = cache, ContextStore(self.num_layers, self.device)
        self.backends = tuple(build_backends(cache, self.contexts, self.attention, self.scale, self.workspace, self.workers))
        self._decode_args = self._layer_views = None
        self.sampler = Sampler(batch, self.vocab_size, self.device)
        self._tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        if self.device.type == "cuda":
            torch._dynamo.mark_static_address(self._tokens)
        return cache

    def retire(self) -> None:
        """Free everything this session holds, compiled steps included: a later Decoder took its model
        over, so it will never decode again (`_need_active` refuses it)."""
        self.release()
        self.workers.close()
        self._compiled = None
        self.active = False

    def release(self) -> None:
        """Free the cache and everything made for it (its CUDA graphs, step context, sampler)."""
        self.cache, self.backends, self.contexts, self._decode_args, self._layer_views = None, (), None, None, None
        self.sampler = self._tokens = self.last_token = None
        if self._compiled is not None:
            self._compiled.drop_graphs()

    def windows_for(self, capacity: int) -> dict[int, int]:
        """The sliding-window layers of a cache of ``capacity`` slots per row, layer -> window: those
        whose window is shorter than the cache. A layer whose window covers every slot attends to the
        whole sequence, as a full layer does, so it is one (the policy runs on it)."""
        return {layer: w for layer, w in enumerate(self.layer_windows) if w is not None and w < capacity}

    def policy_states(self) -> list:
        """The `KVState` of every layer the KV policy runs on (all but the sliding-window layers)."""
        return [backend.state for backend in self.backends if backend.window is None]

    def _summaries(self) -> tuple[str, ...]:
        """The page summaries the cache keeps: those the KV policy reads (`KVSelector.summaries`).
        Every setting decodes with that policy or with `Dense`, which reads none."""
        return tuple(self.kv.summaries) if self.kv is not None else ()

    def _begin(self, batch: int, capacity: int, start: Tensor, length: int, exact: bool = False) -> PagedKVCache:
        """A new sequence batch: rows own slots ``start[b] .. length-1``; the policy's per-layer
        stores and the step context start empty."""
        cache = self.reserve(batch, capacity, exact=exact)
        for backend in self.backends:
            backend.state.layer_states.clear()
        cache.reset(start, length)
        self._room = cache.capacity - length
        parts = self.policy.step_context
        self.contexts.keep_previous = "previous" in parts
        self.contexts.keep_hidden = "hidden" in parts
        self.contexts.keep_rotary = "rotary" in parts
        self.contexts.reset(self.policy.new_request())
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
        prompt = self.open_prompt(input_ids, attention_mask, capacity=capacity, keep_logits=keep_logits)
        with self._phase("prefill"):
            for first in range(0, prompt.length, prompt.chunk):
                last = min(prompt.length, first + prompt.chunk)
                out = self.model(
                    input_ids=prompt.input_ids[:, first:last], position_ids=prompt.positions[:, first:last], use_cache=False,
                    logits_to_keep=keep_logits if last == prompt.length else 1, **{KWARG: self.prompt_args(prompt, first, last)},
                )  # fmt: skip
            self.close_prompt()
        return out.logits

    def open_prompt(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, capacity: int | None = None, keep_logits: int = 1,
        chunks: bool = True,
    ) -> "Prompt":
        """Start a sequence batch for a prompt that forwards of the model will prefill (`prefill`
        runs them; `policyzoo.hf` lets Hugging Face's ``generate`` run them): the inputs checked, a
        cache for ``capacity`` tokens per row begun, and where the prompt goes. ``chunks``: whether
        a long unpadded prompt may be prefilled by several forwards (`PREFILL_TOKENS`)."""
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
        self._begin(b, max(capacity or t, t) + base, start + base, t + base)
        positions = (torch.arange(t, device=input_ids.device)[None, :] - start[:, None]).clamp(min=0)
        padded = bool(start.any())
        chunk = self._prefill_chunk(b, t, keep_logits, padded) if chunks else t
        return Prompt(input_ids, positions, base, padded, chunk)

    def prompt_args(self, prompt: "Prompt", first: int, last: int) -> ForwardArgs:
        """The arguments of the forward that prefills prompt positions ``first .. last - 1``."""
        self.cache.length.fill_(prompt.slot + last)  # what the chunk's summaries and the policy see
        return ForwardArgs("prefill", self.policy, self.backends, PromptChunk(prompt.slot, prompt.padded, first, last == prompt.length))

    def close_prompt(self) -> None:
        """After the prompt's forwards: the policy completes its prefill (`KVSelector.finish_prefill`)."""
        self.policy.finish_prefill(self.policy_states())
        self._drop_graphs_of_old_state()

    def prompt_slot(self, t: int) -> int:
        """The cache slot of position 0 of a ``t``-token prompt: the prompt is placed to end on a
        page boundary. Rows of a batch share slot numbers, so a row's first real token sits at the
        prompt's end minus its length; with the end on a boundary, where that token falls in its
        page depends on the row's own length only. A row's pages, their summaries and what a page
        policy selects are then the same in any batch as when the row runs alone. A policy that
        groups pages into blocks (`KVSelector.slot_alignment`) has the prompt end on a block boundary."""
        align = math.lcm(self.page_size, self.policy.slot_alignment or 1)
        return -t % align

    def _prefill_chunk(self, batch: int, t: int, keep_logits: int, padded: bool) -> int:
        """Prompt positions per prefill forward: all of them, unless the prompt is longer than
        `PREFILL_TOKENS` allows and chunks can serve it (no padding, softmax attention, a policy
        without a prefill of its own, whose hook would see one chunk only)."""
        chunk = max(self.page_size, PREFILL_TOKENS // batch // self.page_size * self.page_size)
        whole = (
            t <= chunk or padded or keep_logits > t - (t - 1) // chunk * chunk
            or self.attention != "softmax" or self.policy.own_prefill
        )  # fmt: skip
        return t if whole else chunk

    def needs_own_prefill(self) -> bool:
        """Whether the policy in use builds state in a prefill of its own (`KVSelector.prefill`, or
        the previous step's selection it reads), so that `load_prefix` needs the prompt's queries."""
        return self.policy.own_prefill or "previous" in self.policy.step_context

    @torch.no_grad()
    def load_prefix(
        self, prefix: Sequence[tuple[Tensor, ...]], start: Tensor, *, capacity: int, exact: bool = False, slot: int | None = None
    ) -> None:
        """Start a sequence batch from keys and values computed elsewhere (a dense prefill shared by
        several settings, or random ones to time a step): ``prefix[layer]`` is ``(k, v)``, each
        ``[B, H_kv, T, D]``, left-padded, with row ``b``'s first real token at ``start[b]``; a policy
        that builds state in its own prefill (`needs_own_prefill`) also needs the prompt's queries,
        ``(k, v, q)`` with ``q [B, H, T, D]``. ``prefix`` may make each layer's tensors as it is
        indexed (one layer in memory at a time). The cache then holds what `prefill` of the same
        prompt would have written, where `prefill` writes it (from slot `prompt_slot`, or from
        ``slot``); ``exact``: a cache of exactly ``capacity`` (plus that slot) tokens (`reserve`)."""
        if len(prefix) != self.num_layers:
            raise ValueError(f"prefix has {len(prefix)} layers, the model {self.num_layers}")
        first = prefix[0]
        b, _, t, _ = first[0].shape
        own = self.needs_own_prefill()
        if own and len(first) < 3:
            raise ValueError(f"{type(self.policy).__name__} builds state in its own prefill: give the prompt's queries, "
                             "(k, v, q) per layer, or call prefill()")
        base = self.prompt_slot(t) if slot is None else slot
        check_count(base, "slot")
        self._begin(b, max(capacity, t) + base, start.to(self.device) + base, t + base, exact=exact)
        for layer, backend in enumerate(self.backends):
            k, v, *q = first if layer == 0 else prefix[layer]
            backend.load(self.policy, k.to(self.dtype), v.to(self.dtype), base, q[0] if own else None)
        if own:
            self.policy.finish_prefill(self.policy_states())
        self._drop_graphs_of_old_state()

    def rewind(self, length: int) -> None:
        """Set every row's length back to ``length`` tokens (a benchmark times the same slot again)."""
        self._need_cache()
        self.cache.rewind(length)
        self._room = self.cache.capacity - length

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
        self._take_room()
        if tokens is not None:
            self.feed(tokens)
        self.sampler.draw()
        with self._phase("decode"):
            args = self._step_args()  # made here, eagerly: a compiled step only reads it
            if self._compiled is None or self._recorder is not None:
                logits, token = self._advance(args)
            else:
                logits, token = self._compiled(self.step_key())
        self.last_token = token
        return logits

    @torch.no_grad()
    def redo_dense(self, tokens: Tensor) -> Tensor:
        """Decode ``tokens`` (the last step's, ``[B]`` or ``[B, 1]``) again at the last step's slot,
        densely (every page, dense projections) and uncompiled; their keys and values replace the
        step's. Returns the dense logits ``[B, V]`` (the reference pass of `policyzoo.eval.compare`)."""
        self._need_cache()
        self.feed(tokens)
        with self._phase("dense_decode"):
            logits = self._forward(ForwardArgs("dense_decode", self._dense, self.backends))
        self.contexts.end_step()
        return logits

    @contextmanager
    def audit(self, recorder: Recorder | None = None) -> Iterator[Recorder]:
        """Record every step in the block with ``recorder`` (a new `policyzoo.eval.audit.Audit` by
        default): dropped mass, output error, kept fractions. Audited steps run eagerly."""
        if recorder is None:
            from .eval.audit import Audit

            recorder = Audit()
        previous = self._recorder
        self._recorder = self.switch.recorder = recorder
        try:
            yield recorder
        finally:
            self._recorder = self.switch.recorder = previous

    # ------------------------------------------------------------------------------ internals
    def _need_cache(self) -> None:
        self._need_active()
        if self.cache is None:
            raise RuntimeError("no sequence batch: call prefill(), load_prefix() or a benchmark's fill first")

    def _take_room(self) -> None:
        """Count one more decode step against the cache's room, or refuse it when the cache is full."""
        self._need_cache()
        if self._room <= 0:
            raise RuntimeError(f"the cache is full ({self.cache.capacity} tokens a row): start the sequence batch "
                               "with a larger capacity (prefill(..., capacity=prompt + tokens to decode))")
        self._room -= 1

    def _need_active(self) -> None:
        if not self.active:
            raise RuntimeError(
                "this Decoder no longer drives its model: a Decoder built later on the same model took it over. "
                "Use the newer Decoder, or wrap a copy of the model (copy.deepcopy) to decode with two side by side"
            )

    def feed(self, tokens: Tensor) -> None:
        """Set the tokens the next `step` decodes (``[B]`` or ``[B, 1]`` ids), as ``step(tokens)``
        would, without stepping: after `load_prefix`, the next step would otherwise decode token 0
        (often a padding id, whose embedding may be all zeros)."""
        self._need_cache()
        if not isinstance(tokens, Tensor) or tokens.numel() != self._tokens.numel() or tokens.is_floating_point():
            shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be an integer tensor of {self._tokens.shape[0]} token ids ([B] or [B, 1]), got {shape}")
        self._tokens.copy_(tokens.reshape(self._tokens.shape))

    @contextmanager
    def _phase(self, phase: Phase) -> Iterator[None]:
        """The model attends through policyzoo, and the projection wrappers run sparse in a decode step
        of a setting with sparse projections, for the block's forwards only."""
        self.switch.sparse = phase == "decode" and self.sparse_proj
        try:
            with _compat.attn_implementation(self.model, ATTN_IMPLEMENTATION):
                yield
        finally:
            self.switch.sparse = False

    def _step_args(self) -> ForwardArgs:
        """This step's arguments: the decode arguments, or, while an audit records, every backend
        wrapped to report to it (`backend.Audited`)."""
        if self._recorder is not None:  # a sliding-window layer has no selection to audit
            layers = tuple(b if b.window is not None else Audited(b, self._recorder) for b in self.backends)
            return ForwardArgs("decode", self.policy, layers)
        return self._args()

    def _args(self) -> ForwardArgs:
        """The decode steps' arguments: one object per cache and setting, so a compiled step reads
        the same object at every step."""
        if self._decode_args is None:
            self._decode_args = ForwardArgs("decode", self.policy, self.backends)
        return self._decode_args

    def _layer_args(self) -> list[ForwardArgs]:
        """Each layer's decode arguments for one compiled layer that serves every layer: the layer's
        backend as layer 0 of a one-layer cache (`Backend.view`), made once per cache and setting."""
        if self._layer_views is None:
            args = self._args()
            self._layer_views = [args.for_layer(backend.view()) for backend in self.backends]
        return self._layer_views

    def token_positions(self) -> Tensor:
        """``int64[B, 1]``: the RoPE position of the token at slot ``length - 1``, its index among its
        row's real tokens."""
        return (self.cache.length - 1 - self.cache.start).clamp(min=0)[:, None]

    def open_step(self) -> ForwardArgs:
        """Before a decode forward: the cache advances (every layer writes at the new ``length - 1``);
        returns the step's arguments (`policyzoo.hf` runs the forward; `step` does it itself)."""
        self._take_room()
        args = self._step_args()
        self._begin_step(args)
        return args

    def _begin_step(self, args: ForwardArgs) -> None:
        """Before a decode forward: nothing of a step an exception cut short remains, the cache
        advances (every layer writes at the new ``length - 1``) and a policy that selects the same in
        every layer (`KVSelector.same_every_layer`) selects, once for all layers (`ContextStore.share`)."""
        self.contexts.end_step()
        self.cache.length += 1
        if args.phase == "decode" and args.policy.same_every_layer:
            state = next((b.state for b in self.backends if b.window is None), None)
            if state is not None:  # a query of no heads: such a select reads only its batch and device
                q = torch.empty(self.cache.batch, 0, self.cache.head_dim, dtype=state.keys.dtype, device=self.cache.device)
                sel = args.policy.select(state, q)
                if self._dynamic_capacity:
                    mark_selection_dynamic(sel)
                self.contexts.share(sel)

    def close_step(self) -> None:
        """After a decode forward: what lived for the step goes, and the step index advances."""
        self.contexts.end_step()
        self.contexts.advance()

    def _forward(self, args: ForwardArgs) -> Tensor:
        """The model on ``_tokens`` at slot ``length - 1``."""
        out = self.model(input_ids=self._tokens, position_ids=self.token_positions(), use_cache=False, logits_to_keep=1,
                         **{KWARG: args})
        return out.logits[:, -1]

    def _decode_step(self) -> tuple[Tensor, Tensor]:
        """The compiled unit: one decode step with the decode arguments (`_args`, made before).
        Only device tensors change, in place."""
        return self._advance(self._decode_args)

    def _advance(self, args: ForwardArgs) -> tuple[Tensor, Tensor]:
        """Advance the cache (every layer writes at the new ``length - 1``), run the model, choose the
        next tokens and feed them to the next step."""
        self._begin_step(args)
        logits = self._forward(args)
        self.close_step()
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
        layout = policy_state_layout(self.backends, self.contexts)
        if layout != self._graph_state:
            if self._compiled is not None:
                self._compiled.drop_graphs()
            self._graph_state = layout
