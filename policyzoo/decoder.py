"""`Decoder`: wraps a Hugging Face causal LM for sparse decoding.

The whole decode loop lives here: dense prefill (SDPA) fills the paged cache, then each step runs
the model on one token per row through the registered attention function, which asks the KV policy
for a `Selection` and attends through `policyzoo.kernels`. Projection sparsifiers wrap the linear
layers and act in decode only. The step is a plain function of the input tokens, so it compiles
(`torch.compile`, CUDA graphs on GPU) once and replays for every step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import _compat, kernels
from .attention import ATTN_IMPLEMENTATION, Runtime
from .cache import PagedKVCache
from .kv.base import KVSelector, KVState
from .kv.dense import Dense
from .proj.base import ProjectionSparsifier, fuse_shared_inputs
from .proj.base import uninstall as uninstall_projections

DEFAULT_PAGE_SIZE = 16


class Decoder:
    """Sparse decoding over a loaded HF causal LM (Llama, Mistral, Qwen2, Qwen3 families).

    Args:
        model: a ``*ForCausalLM`` model; it is modified in place: its attention implementation
            while decoding, and its linear layers (``proj``'s wrappers; on CUDA, q/k/v and gate/up
            become one GEMM each over a shared weight buffer). `policyzoo.proj.base.uninstall(model)`
            puts the plain linears back; a new Decoder on the same model replaces the old wrappers.
        kv: a KV policy (`Window`, `AttentionTopK`, `Quest`, ...); ``None`` attends densely.
        proj: a projection sparsifier (`TopK`, `Threshold`); ``None`` keeps projections dense.
        page_size: cache page size; defaults to the policy's page (e.g. ``Quest(page=32)``) or 16.
        compile: compile the decode step with ``torch.compile`` (``"reduce-overhead"`` on CUDA).
        dtype, device: of the KV cache; default to the model's. They must match the model.
        gate: a calibrated `policyzoo.gate.Gate`: each `generate` call then decodes with the setting
            it chooses among those this Decoder offers (`available_settings`: ``dense``, ``proj``,
            ``kv``, ``both``) for the request's context, taken as the prompt length (the padded
            ``input_ids.shape[1]``) plus ``max_new_tokens // 2``: the mean context of the request's
            decode steps (where the predicted step time of a curve linear over the request is its
            mean, so the choice minimises the predicted decode time). The whole batch of one call
            shares the setting; ``last_choice`` records it. A compiled step recompiles once per
            distinct setting (the KV policy and the projection switch are guarded constants), then
            replays.

    ``setting`` is what the next request decodes with (`use` changes it; it starts as everything
    the Decoder was given) and ``last_choice`` what the last `generate` call decoded with.
    """

    def __init__(
        self,
        model: nn.Module,
        kv: KVSelector | None = None,
        proj: ProjectionSparsifier | None = None,
        *,
        page_size: int | None = None,
        compile: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        gate: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a transformers model (nn.Module), got {type(model).__name__}")
        _compat.check_supported(model)
        if kv is not None and not isinstance(kv, KVSelector):
            raise TypeError(f"kv must be a KVSelector (e.g. Quest(...)) or None, got {type(kv).__name__}")
        if proj is not None and not isinstance(proj, ProjectionSparsifier):
            raise TypeError(f"proj must be a ProjectionSparsifier (e.g. TopK(0.5)) or None, got {type(proj).__name__}")
        self.model, self.kv, self.proj = model, kv, proj
        self.page_size = _resolve_page_size(page_size, kv)
        param = next(model.parameters())
        self.dtype = dtype or param.dtype
        self.device = torch.device(device) if device is not None else param.device
        self._check_model_placement()
        if self.device.type == "cuda":  # the kernels' counters, made before any CUDA graph is recorded
            kernels.scratch.reserve(self.device)
        self.num_heads, self.num_kv_heads, self.head_dim = _compat.head_dims(model)
        self.num_layers = len(_compat.decoder_layers(model))
        self.runtime = Runtime(policy=kv if kv is not None else Dense())
        for layer, attn in enumerate(_compat.attention_modules(model)):
            previous = getattr(attn, "_policyzoo", None)
            if previous is not None:
                # A Decoder that wrapped this model before no longer drives it: free its cache now
                # rather than when the cycle collector finds it (a 128K cache is 17 GB on an 8B model).
                previous[0].cache, previous[0].states = None, []
            attn._policyzoo = (self.runtime, layer)
        uninstall_projections(model)  # a model re-wrapped by a new Decoder drops the old wrappers
        if proj is not None:
            proj.install(model, self.runtime)
        else:
            fuse_shared_inputs(model, self.runtime)  # q/k/v and gate/up as one GEMM each (kernel path)
        self._dense = self.runtime.policy if kv is None else Dense()  # one instance: a compiled step guards on it
        self.setting = ("both" if proj is not None else "kv") if kv is not None else ("proj" if proj is not None else "dense")
        self.last_choice: str | None = None
        if gate is not None:
            from .gate import Gate

            if not isinstance(gate, Gate):
                raise TypeError(f"gate must be a policyzoo.gate.Gate (e.g. Gate.load(path)) or None, got {type(gate).__name__}")
            gate.warn_if_mismatched(kv, proj, self.device)
        self.gate = gate
        self.tokenizer: Any = None
        self.last_audit = None
        self._step = self._decode_step
        self._dynamic_capacity = False
        if compile:
            self.compile()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        kv: KVSelector | None = None,
        proj: ProjectionSparsifier | None = None,
        *,
        page_size: int | None = None,
        compile: bool = False,
        **hf_kwargs: Any,
    ) -> "Decoder":
        """Load a model by Hub name, local path, or ``"smollm2-135m"`` (the embedded default) and wrap it."""
        from .assets import load_model

        model, tokenizer = load_model(name_or_path, **hf_kwargs)
        dec = cls(model, kv=kv, proj=proj, page_size=page_size, compile=compile)
        dec.tokenizer = tokenizer
        return dec

    def compile(self, mode: str | None = None, dynamic_capacity: bool = False) -> "Decoder":
        """Compile the decode step; ``mode`` defaults to ``"reduce-overhead"`` (CUDA graphs) on CUDA.

        The step never recompiles from one token to the next. A request that needs a larger cache
        (a longer prompt or more new tokens) gets a new cache, whose shapes compile a new step (a
        minute or more for an 8B model on a GPU). With ``dynamic_capacity=True`` the cache's capacity
        is traced as a symbol instead, so later capacities reuse the compiled step (on CUDA a new CUDA
        graph is still recorded per capacity); a policy whose code depends on the capacity's value
        costs a recompile.
        """
        if mode is None and self.device.type == "cuda":
            mode = "reduce-overhead"
        self._dynamic_capacity = dynamic_capacity
        if dynamic_capacity:
            # Inductor's rewrite of a scatter into a zero tensor as a pointwise select gave `SSA` a
            # wrong selection with symbolic sizes (a sampled page lost on caches of up to 8 pages;
            # aot_eager and this build match eager). `options` replaces `mode`: same settings.
            modal = torch._inductor.list_mode_options(mode) if mode else {}
            options = {**modal, "optimize_scatter_upon_const_tensor": False}
            self._step = torch.compile(self._decode_step, options=options, dynamic=None)
            if self.runtime.cache is not None:  # later caches are marked as `_prepare_cache` makes them
                self._mark_capacity_dynamic(self.runtime.cache)
        else:
            self._step = torch.compile(self._decode_step, mode=mode, dynamic=False)
        return self

    @staticmethod
    def _mark_capacity_dynamic(cache: PagedKVCache) -> None:
        # maybe_: a value the code specialises on recompiles instead of raising.
        for t in cache.tensors():
            if t.dim() == 4:  # keys/values [B, H_kv, capacity, D], summaries [B, H_kv, pages, D]
                torch._dynamo.maybe_mark_dynamic(t, 2)

    def available_settings(self) -> tuple[str, ...]:
        """The settings this Decoder can decode with: ``dense`` always, ``proj`` with a projection
        sparsifier, ``kv`` with a KV policy, ``both`` with both."""
        have = {"dense": True, "proj": self.proj is not None, "kv": self.kv is not None}
        have["both"] = have["proj"] and have["kv"]
        return tuple(s for s, ok in have.items() if ok)

    def use(self, setting: str) -> "Decoder":
        """Decode the next requests with ``setting``: ``dense`` (every KV page, dense projections),
        ``proj`` (sparse projections only), ``kv`` (the KV policy only) or ``both``.

        A Decoder without a gate keeps the setting (it starts as everything it was given); a gated
        Decoder sets it at every `generate` call.
        """
        if setting not in self.available_settings():
            raise ValueError(f"setting must be one of {', '.join(self.available_settings())} for this Decoder, got {setting!r}")
        self.runtime.policy = self.kv if setting in ("kv", "both") else self._dense
        self.runtime.sparse_proj = setting in ("proj", "both")
        self.setting = setting
        return self

    def __repr__(self) -> str:
        return f"Decoder({type(self.model).__name__}, kv={self.kv!r}, proj={self.proj!r}, page_size={self.page_size})"

    # ------------------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        attention_mask: Tensor | None = None,
        streamer: Any = None,
        *,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        audit: bool = False,
        progress: bool = False,
        output_logits: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Decode up to ``max_new_tokens`` per row; returns ``[B, T + new]`` token ids.

        ``attention_mask`` marks real tokens (1) of a left-padded batch. Sampling uses
        ``temperature`` and nucleus ``top_p``. ``streamer`` follows the HF streamer protocol
        (``put`` / ``end``). ``audit=True`` records dropped mass, output error and kept fractions
        against dense attention in ``self.last_audit`` (it runs the step uncompiled).
        ``output_logits=True`` also returns the logits each new token was chosen from,
        ``float32[B, new, V]``.
        """
        input_ids, attention_mask = self._check_inputs(input_ids, attention_mask)
        _check_generation_args(max_new_tokens, temperature, top_p)
        self._check_model_placement()
        if self.device.type == "cuda":  # the kernels' counters, made before any CUDA graph is recorded
            kernels.scratch.reserve(self.device)
        b, t = input_ids.shape
        eos = _eos_ids(self.model, eos_token_id)
        pad = pad_token_id if pad_token_id is not None else _pad_id(self.model, eos)
        window = _compat.sliding_window(self.model)
        if window is not None and t + max_new_tokens > window:
            raise ValueError(
                f"input_ids: prompt + max_new_tokens = {t + max_new_tokens} exceeds the model's sliding window "
                f"({window}); sliding-window attention is not supported"
            )

        if self.gate is not None:
            self.use(self.gate.choose(t + max_new_tokens // 2, self.available_settings()))
        self.last_choice = self.setting

        from .eval.audit import Audit

        self.runtime.audit = Audit() if audit else None
        step = self._step if self.runtime.audit is None else self._decode_step
        out, scores = [input_ids], []
        finished = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        bar = tqdm(total=max_new_tokens, desc="decode", disable=not progress, leave=False)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        try:
            with _compat.attn_implementation(self.model, ATTN_IMPLEMENTATION):
                start = (attention_mask == 0).sum(1)
                self._prepare_cache(b, t + max_new_tokens, start, t)
                logits = self._prefill(input_ids, start)
                for i in range(max_new_tokens):
                    if output_logits:
                        scores.append(logits.float().clone())  # a CUDA-graph output is reused next step
                    token = sample_next(logits, do_sample, temperature, top_p, generator)
                    token = torch.where(finished, torch.full_like(token, pad), token)
                    out.append(token[:, None])
                    if streamer is not None:
                        streamer.put(token.cpu())
                    bar.update(1)
                    if eos:
                        finished |= torch.isin(token, torch.tensor(eos, device=token.device))
                        if bool(finished.all()):
                            break
                    if i + 1 < max_new_tokens:
                        self.runtime.phase = "decode"
                        logits = step(token[:, None])
        finally:
            bar.close()
            self.runtime.phase = "idle"
            if streamer is not None:
                streamer.end()
            self.last_audit, self.runtime.audit = self.runtime.audit, None
        sequences = torch.cat(out, dim=1)
        return (sequences, torch.stack(scores, dim=1)) if output_logits else sequences

    # ------------------------------------------------------------------------------ internals
    @torch.no_grad()
    def _prefill(self, input_ids: Tensor, start: Tensor) -> Tensor:
        t = input_ids.shape[1]
        positions = (torch.arange(t, device=input_ids.device)[None, :] - start[:, None]).clamp(min=0)
        self.runtime.phase = "prefill"
        try:
            logits = self.model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=1).logits
        finally:
            self.runtime.phase = "idle"
        return logits[:, -1]

    @torch.no_grad()
    def _decode_step(self, tokens: Tensor, advance: bool = True) -> Tensor:
        """One decode step for ``tokens [B, 1]``; returns next-token logits ``[B, V]``.

        The new token goes to slot ``length`` (the cache advances first, so every layer writes at
        ``length - 1``); its RoPE position is its index among the row's real tokens.
        ``advance=False`` rewrites the last slot instead (a second pass over the same token).
        """
        cache = self.runtime.cache
        if advance:
            cache.length += 1
        positions = (cache.length - 1 - cache.start).clamp(min=0)[:, None]
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=False, logits_to_keep=1)
        return out.logits[:, -1]

    def _prepare_cache(self, batch: int, needed: int, start: Tensor, length: int) -> None:
        cache = self.runtime.cache
        capacity = math.ceil(needed / self.page_size) * self.page_size
        if cache is None or cache.batch != batch or cache.capacity < capacity:
            self.runtime.cache, self.runtime.states, cache = None, [], None  # free the old one first
            cache = PagedKVCache(
                self.num_layers, batch, self.num_kv_heads, self.head_dim, capacity,
                page_size=self.page_size, dtype=self.dtype, device=self.device, summaries=self._summaries(),
            )  # fmt: skip
            self.runtime.cache = cache
            if self._dynamic_capacity:
                self._mark_capacity_dynamic(cache)
            scale = self.head_dim**-0.5
            self.runtime.states = [KVState(cache, layer, scale) for layer in range(self.num_layers)]
        for state in self.runtime.states:
            state.store.clear()
        cache.reset(start, length)

    def _summaries(self) -> tuple[str, ...]:
        """The page summaries the cache must keep: those the KV policy reads (`KVSelector.summaries`).
        Every setting `use` can pick decodes with that policy or with `Dense`, which reads none."""
        return tuple(self.kv.summaries) if self.kv is not None else ()

    def _check_model_placement(self) -> None:
        param = next(self.model.parameters())
        if param.device != self.device or param.dtype != self.dtype:
            raise ValueError(
                f"model is on {param.device} / {param.dtype} but the cache is for {self.device} / {self.dtype}; "
                "move the model back or build the Decoder with matching device= and dtype="
            )

    def _check_inputs(self, input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.long, torch.int32):
            raise TypeError("input_ids must be an integer tensor of shape [batch, tokens]")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape [batch, tokens] with tokens >= 1, got {tuple(input_ids.shape)}")
        if input_ids.device != self.device:
            raise ValueError(f"input_ids are on {input_ids.device} but the model is on {self.device}")
        input_ids = input_ids.long()
        if attention_mask is None:
            return input_ids, torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        mask = attention_mask.to(input_ids.device).long()
        if bool(((mask != 0) & (mask != 1)).any()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError("attention_mask must be 0/1 and left-padded (zeros before the ones in every row)")
        if bool((mask[:, -1] == 0).any()):
            raise ValueError("attention_mask: every row needs at least one real token")
        return input_ids, mask


def sample_next(
    logits: Tensor, do_sample: bool, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> Tensor:
    """Greedy argmax, or a sample from ``softmax(logits / temperature)`` restricted to nucleus ``top_p``."""
    if not do_sample:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keeps at least the top token
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -torch.inf))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _resolve_page_size(page_size: int | None, kv: KVSelector | None) -> int:
    wanted = getattr(kv, "page_size", None) if kv is not None else None
    if page_size is not None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if wanted is not None and wanted != page_size:
            raise ValueError(f"page_size={page_size} conflicts with the policy's page={wanted}")
        return page_size
    return wanted or DEFAULT_PAGE_SIZE


def _check_generation_args(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _eos_ids(model: nn.Module, eos_token_id: int | list[int] | None) -> list[int]:
    if eos_token_id is None:
        cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


def _pad_id(model: nn.Module, eos: list[int]) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return pad
