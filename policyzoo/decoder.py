"""`Decoder`: wraps a Hugging Face causal LM for sparse decoding.

The Decoder installs policyzoo on a model (the attention function, the projection wrappers, the
step-context hooks) and owns its `DecodeSession`, the one holder of decode state: dense prefill
(SDPA) fills the paged cache, then each step runs the model on one token per row through the
registered attention function, which asks the KV policy for a `Selection` and attends through
`policyzoo.kernels`. `generate` is the loop users call; it never waits for the device between steps
(`streaming.TokenOutbox`), so a compiled step replayed as a CUDA graph sets its pace.
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import nullcontext
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import _compat, kernels
from .attention import register as register_attention
from .backend import ATTENTIONS
from .distributed import shard_of
from .forward import KWARG, ForwardArgs
from .kv.base import KVSelector, check_count
from .kv.context import check_parts
from .kv.dense import Dense
from .offload import Offload
from .proj.base import ProjectionSparsifier, ProjectionSwitch, fuse_shared_inputs
from .proj.base import uninstall as uninstall_projections
from .regional import layer_invariant
from .sampling import check_settings, is_token
from .session import DecodeSession
from .streaming import TokenOutbox

DEFAULT_PAGE_SIZE = 16


class SettingChooser(Protocol):
    """What a Decoder's ``gate`` provides (`policyzoo.gate.Gate`)."""

    def choose(self, context: float, available: Any = None) -> str: ...

    def warn_if_mismatched(self, kv: Any, proj: Any, device: torch.device | str) -> None: ...


class Decoder:
    """Sparse decoding over a loaded HF causal LM (Llama, Mistral, Qwen2, Qwen3, Gemma-2, Gemma-3 families;
    sliding-window layers keep a window of their own and the KV policy runs on the full layers, see
    docs/policies.md).

    Args:
        model: a ``*ForCausalLM`` model; it is modified in place: its attention implementation
            while decoding, and its linear layers (``proj``'s wrappers; on CUDA, q/k/v and gate/up
            become one GEMM each over a shared weight buffer). `policyzoo.proj.base.uninstall(model)`
            puts the plain linears back; a new Decoder on the same model replaces the old wrappers.
        kv: a KV policy (`Window`, `AttentionTopK`, `Quest`, ...); ``None`` attends densely. A
            policy with learned parameters is moved to the model's device and dtype.
        proj: a projection sparsifier (`TopK`, `Threshold`); ``None`` keeps projections dense.
        page_size: cache page size; defaults to the policy's page (e.g. ``Quest(page=32)``) or 16.
        compile: compile the decode step (`compile`).
        dtype, device: of the KV cache; default to the model's. They must match the model.
        offload: keep some layers' keys and values in pinned host memory, read by the GPU in place
            (`policyzoo.offload.Offload`, e.g. ``Offload(layers=8)``): for contexts whose cache does
            not fit beside the weights. ``None`` keeps the whole cache on the device.
        gate: a calibrated `policyzoo.gate.Gate`: each `generate` call then decodes with the setting
            it chooses among those this Decoder offers (`available_settings`: ``dense``, ``proj``,
            ``kv``, ``both``) for the request's context, taken as the prompt length (the padded
            ``input_ids.shape[1]``) plus ``max_new_tokens // 2``: the mean context of the request's
            decode steps (where the predicted step time of a curve linear over the request is its
            mean, so the choice minimises the predicted decode time). The whole batch of one call
            shares the setting; ``last_choice`` records it. A compiled step compiles once per
            distinct setting, then replays.

    ``session`` (a `DecodeSession`) holds the decode state: the cache, the setting (``setting``;
    `use` changes it; it starts as everything the Decoder was given), audits, the compiled step.
    ``last_choice`` is what the last `generate` call decoded with.
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
        gate: SettingChooser | None = None,
        offload: Offload | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a transformers model (nn.Module), got {type(model).__name__}")
        _compat.check_supported(model)
        if kv is not None and not isinstance(kv, KVSelector):
            raise TypeError(f"kv must be a KVSelector (e.g. Quest(...)) or None, got {type(kv).__name__}")
        if proj is not None and not isinstance(proj, ProjectionSparsifier):
            raise TypeError(f"proj must be a ProjectionSparsifier (e.g. TopK(0.5)) or None, got {type(proj).__name__}")
        if gate is not None and not (callable(getattr(gate, "choose", None)) and callable(getattr(gate, "warn_if_mismatched", None))):
            raise TypeError(f"gate must be a policyzoo.gate.Gate (e.g. Gate.load(path)) or None, got {type(gate).__name__}")
        if kv is not None:
            check_parts(kv.step_context, type(kv).__name__)
            if kv.attention == "entmax" and getattr(model.config, "attention_kind", None) != "entmax":
                warnings.warn(
                    f"{type(kv).__name__}(attention='entmax') makes {type(model).__name__} attend with 1.5-entmax in prefill and "
                    "decode; a model trained with softmax then decodes differently from its own forward. Mark an entmax "
                    "model with model.config.attention_kind = 'entmax' (which silences this)", stacklevel=2,
                )  # fmt: skip
        _check_flags(compile=compile)
        _check_layer_kinds(model, kv)
        if offload is not None and not isinstance(offload, Offload):
            raise TypeError(f"offload must be a policyzoo.Offload (e.g. Offload(layers=8)) or None, got {type(offload).__name__}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
        if proj is not None and shard_of(model) is not None and not proj.shardable:
            raise NotImplementedError(f"{type(proj).__name__} does not decode a tensor-parallel (sharded) model: use TopK or Threshold")
        offloaded = _compat.offloaded_parameters(model)
        if proj is not None and offloaded:
            raise ValueError(
                f"proj= reads each projection's weight itself, but {len(offloaded)} parameters are offloaded "
                f"(on the meta device until accelerate's hooks load them, e.g. {offloaded[0]}); load the model "
                "without offloading (a device_map that keeps every layer on a device), or decode with kv= only"
            )
        self.model, self.kv, self.proj = model, kv, proj
        self.page_size = _resolve_page_size(page_size, kv)
        param = next(model.parameters())
        self.dtype = dtype if dtype is not None else param.dtype
        self.device = _device(device) if device is not None else param.device
        self._check_model_placement()
        if kv is not None:
            kv.attach(model)
            kv.to(device=self.device, dtype=self.dtype)  # learned parameters, if the policy has any
        # The kernels' scratch for this device, made before any CUDA graph is recorded (`kernels.Workspace`).
        self.workspace = kernels.Workspace(self.device) if self.device.type == "cuda" else None
        dense = Dense()  # the dense setting's policy: one instance, so a compiled step guards on it
        register_attention()
        self.switch = ProjectionSwitch()
        self.session = DecodeSession(
            model, kv=kv, proj=proj is not None, dense=dense, switch=self.switch,
            attention=attention_of(kv) if kv is not None else "softmax", page_size=self.page_size, dtype=self.dtype,
            device=self.device, offload=offload, workspace=self.workspace,
        )  # fmt: skip
        self._install(fuse=not offloaded)
        self.last_choice: str | None = None
        if gate is not None:
            gate.warn_if_mismatched(kv, proj, self.device)
        self.gate = gate
        self.tokenizer: Any = None
        self.last_audit = None
        if compile:
            self.compile()

    def _install(self, fuse: bool = True) -> None:
        """Take the model over: retire the session of a Decoder that wrapped it before (its cache, CUDA
        graphs and compiled steps are freed now rather than when the cycle collector finds them: a
        128K cache is 17 GB on an 8B model), install this Decoder's projection wrappers (``fuse``:
        group q/k/v and gate/up weights when there is no sparsifier; not for offloaded weights) and,
        where the policy reads them, the hooks that hand each layer's input to the step context."""
        model = self.model
        ModelLease.take(model, self.session)
        if self.kv is not None and {"hidden", "rotary"} & set(self.kv.step_context):
            # The hidden state entering the layer and its rotary embedding (`StepContext.hidden`,
            # `.rotary`); only where a policy reads them, so that other models keep no hook.
            for layer, block in enumerate(_compat.decoder_layers(model)):
                block.register_forward_pre_hook(partial(_record_hidden, layer), with_kwargs=True)
        uninstall_projections(model)  # a model re-wrapped by a new Decoder drops the old wrappers
        if self.proj is not None:
            self.proj.install(model, self.switch, self.workspace)
        elif fuse:  # fusing copies the weights: not offloaded ones
            fuse_shared_inputs(model, self.switch, self.workspace)  # q/k/v and gate/up as one GEMM each (kernel path)

    def detach(self) -> None:
        """Give the model back: remove this Decoder's hooks and projection wrappers (the linears come
        back with their weights in their own layout) and retire its session. A detached Decoder
        refuses to decode."""
        ModelLease.release(self.model, self.session)
        uninstall_projections(self.model)
        self.session.retire()

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

    def compile(
        self,
        mode: str | None = None,
        dynamic_capacity: bool = False,
        cuda_graphs: bool | None = None,
        backend: str = "inductor",
        regional: bool | None = None,
    ) -> "Decoder":
        """Compile the decode step with ``torch.compile``; returns the Decoder.

        On CUDA the session captures the compiled step in a CUDA graph per cache and setting and
        replays it (``cuda_graphs``, default on for CUDA): a replay costs the host tens of
        microseconds. ``mode`` and ``backend`` are torch.compile's (``backend="eager"`` keeps the
        eager kernels, unfused, under the CUDA graph; ``mode="reduce-overhead"`` records CUDA graphs
        itself and needs ``cuda_graphs=False``).

        The step never recompiles from one token to the next. A request that needs a larger cache
        (a longer prompt or more new tokens) gets a new cache, whose shapes compile a new step (a
        minute or more for an 8B model on a GPU). With ``dynamic_capacity=True`` the cache's capacity
        is traced as a symbol instead, so later capacities reuse the compiled step (a new CUDA graph
        is still captured per cache); a policy whose code depends on the capacity's value costs a
        recompile.

        ``regional`` compiles one decoder layer and reuses it for every layer (`policyzoo.regional`),
        around an eager rest of the step: the compile costs about one layer's instead of the whole
        model's. The default (``None``) is regional wherever the KV policy and the projection
        sparsifier allow it (`regional.layer_invariant`: the built-in policies without a step
        context, `TopK`); ``False`` traces the whole step into one graph; ``True`` also compiles a
        policy or sparsifier of another class by layer (its ``select`` must not depend on
        ``state.layer``: it sees each layer as layer 0 of a one-layer cache), and raises for a
        policy that reads the step context.
        """
        _check_compile_args(mode, dynamic_capacity, cuda_graphs, backend, regional)
        if dynamic_capacity and (why := dynamic_capacity_refused(self, backend)):
            raise ValueError(f"dynamic_capacity=True: {why}")
        ok, why, forceable = layer_invariant(self.kv, self.proj)
        if regional and not (ok or forceable):
            raise ValueError(f"regional=True: {why}; compile the whole step (regional=False)")
        regional = ok if regional is None else regional
        self.session.compile(mode, dynamic_capacity=dynamic_capacity, cuda_graphs=cuda_graphs, backend=backend, regional=regional)
        return self

    @property
    def setting(self) -> str:
        """The setting the next request decodes with (`use`)."""
        return self.session.setting

    def available_settings(self) -> tuple[str, ...]:
        """The settings this Decoder can decode with: ``dense`` always, ``proj`` with a projection
        sparsifier, ``kv`` with a KV policy, ``both`` with both."""
        return self.session.available_settings()

    def use(self, setting: str) -> "Decoder":
        """Decode the next requests with ``setting``: ``dense`` (every KV page, dense projections),
        ``proj`` (sparse projections only), ``kv`` (the KV policy only) or ``both``.

        A Decoder without a gate keeps the setting (it starts as everything it was given); a gated
        Decoder sets it at every `generate` call.
        """
        self.session.use(setting)
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
        ``temperature`` and nucleus ``top_p`` (draws from ``generator`` when given). A row that
        chooses an ``eos_token_id`` (default: the model's generation config) is finished: it gets
        ``pad_token_id`` from then on, and decoding stops once every row has finished. ``streamer``
        follows the HF streamer protocol (``put`` / ``end``): it gets the prompt, then each step's
        tokens as the device delivers them. ``audit=True`` records dropped mass, output error and
        kept fractions against dense attention in ``self.last_audit`` (it runs the step uncompiled).
        ``output_logits=True`` also returns the logits each new token was chosen from,
        ``float32[B, new, V]``. ``progress=True`` shows a bar: the prefill while it runs, then the
        tokens as they come.
        """
        session = self.session
        input_ids, attention_mask = session.check_inputs(input_ids, attention_mask)
        check_count(max_new_tokens, "max_new_tokens", minimum=1)
        check_settings(do_sample=do_sample, temperature=temperature, top_p=top_p, generator=generator, device=self.device)
        _check_flags(audit=audit, progress=progress, output_logits=output_logits)
        if streamer is not None and (isinstance(streamer, type) or not all(callable(getattr(streamer, m, None)) for m in ("put", "end"))):
            raise TypeError(f"streamer must be an object with put() and end() (the HF streamer protocol) or None, got {streamer!r}")
        self._check_model_placement()
        b, t = input_ids.shape
        eos = _eos_ids(self.model, eos_token_id, session.vocab_size)
        pad = _pad_id(self.model, pad_token_id, eos, session.vocab_size)
        _compat.check_positions(self.model, t + max_new_tokens, f"prompt ({t}) + max_new_tokens ({max_new_tokens})")
        if self.gate is not None:
            session.use(self.gate.choose(t + max_new_tokens // 2, self.available_settings()))
        self.last_choice = session.setting

        # The bar names the prefill while it runs (a long prompt on a CPU takes a while), then counts tokens.
        bar = tqdm(total=max_new_tokens, desc=f"prefill {t} tokens", unit="tok", disable=not progress, leave=False)
        outbox = TokenOutbox(b, max_new_tokens, self.device, streamer, on_token=lambda: bar.update(1))
        scores: list[Tensor] = []
        if streamer is not None:
            streamer.put(input_ids.cpu())
        recorder = None
        try:
            logits = session.prefill(input_ids, attention_mask, capacity=t + max_new_tokens)[:, -1]
            bar.set_description("decode")
            session.sample(do_sample=do_sample, temperature=temperature, top_p=top_p, eos_token_id=eos, pad_token_id=pad, generator=generator)
            with session.audit() if audit else nullcontext() as recorder:
                session.choose(logits)
                while True:
                    if output_logits:
                        scores.append(logits.float().clone())  # a CUDA-graph output is reused next step
                    outbox.push(session.sampler.report)
                    if outbox.pushed == max_new_tokens or not outbox.ready_for_next():
                        break
                    logits = session.step()
                outbox.collect(outbox.pushed - 1)
        finally:
            bar.close()
            if streamer is not None:
                streamer.end()
            self.last_audit = recorder
        new = outbox.tokens().to(input_ids.device)
        sequences = torch.cat([input_ids, new], dim=1)
        if not output_logits:
            return sequences
        return sequences, torch.stack(scores[: new.shape[1]], dim=1)

    # ------------------------------------------------------------------------------ internals
    def _check_model_placement(self) -> None:
        param = next(self.model.parameters())
        if param.device != self.device or param.dtype != self.dtype:
            raise ValueError(
                f"model is on {param.device} / {param.dtype} but the cache is for {self.device} / {self.dtype}; "
                "move the model back or build the Decoder with matching device= and dtype="
            )


def _check_layer_kinds(model: nn.Module, kv: KVSelector | None) -> None:
    """Refuse a KV policy that cannot serve a model that mixes sliding-window and full layers
    (`_compat.layer_windows`): one attending with entmax (a window layer attends with the model's
    softmax), or one that reads the layer below's selection or the rotary embedding (the layer below
    may be a window layer, whose selection is not the policy's, and the full layers' rotary embedding
    may not be the one layer 0 receives: Gemma-3's differs). A model whose layers all have one window
    (Mistral) runs a policy on every layer while its cache fits the window, on none beyond it
    (`WindowLayer` refuses entmax there)."""
    windows = _compat.layer_windows(model.config)
    if kv is None or all(w is None for w in windows) or all(w is not None for w in windows):
        return
    name = type(kv).__name__
    if kv.attention != "softmax":
        raise ValueError(f"{name}(attention={kv.attention!r}): {model.config.model_type} has sliding-window layers, "
                         "which attend with softmax; decode it with a softmax policy")
    reads = sorted({"below", "rotary"} & set(kv.step_context))
    if reads:
        raise ValueError(
            f"{name} reads the step context {reads}, which a model that mixes sliding-window and full layers "
            f"({model.config.model_type}) does not give it faithfully (the layer below may be a window layer; "
            "the full layers' rotary embedding may differ from layer 0's): use a policy without it"
        )


def _record_hidden(layer: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of decoder layer ``layer``: hand the hidden state entering it, and the rotary
    embedding it receives, to the step context of the session driving the forward (kept only while
    the policy in use reads them)."""
    forward = kwargs.get(KWARG)
    if not isinstance(forward, ForwardArgs) or forward.single:
        return
    contexts = forward.layers[layer].contexts
    if contexts.keep_hidden:
        contexts.record_hidden(layer, args[0] if args else kwargs["hidden_states"])
    if contexts.keep_rotary and layer == 0:  # every layer receives the same
        contexts.record_rotary(kwargs.get("position_embeddings"))


class ModelLease:
    """Which session drives a model: a forward pre-hook on the model, so a later Decoder finds it
    there (`take`). Its forwards need nothing from it; it exists to be found and revoked. It names
    its model too: a copy of the model (``copy.deepcopy``) carries a copy of the lease, which must
    not retire the original's session."""

    def __init__(self, model: nn.Module, session: DecodeSession) -> None:
        self.model, self.session = weakref.ref(model), weakref.ref(session)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        return None

    @classmethod
    def take(cls, model: nn.Module, session: DecodeSession) -> None:
        """Give ``model`` to ``session``: the lease before goes with the layer hooks its Decoder
        registered, and its session, if it still exists, retires (frees its cache, graphs and
        compiled steps, and refuses to decode from then on)."""
        old = cls.release(model)
        if old is not None:
            old.retire()
        model.register_forward_pre_hook(cls(model, session))

    @classmethod
    def release(cls, model: nn.Module, session: DecodeSession | None = None) -> DecodeSession | None:
        """Remove ``model``'s lease (only ``session``'s, when given) and the layer hooks of its
        Decoder; returns the session that held it, if it still exists."""
        held = None
        for key, hook in list(model._forward_pre_hooks.items()):
            if isinstance(hook, cls):
                owner = hook.session() if hook.model() is model else None
                if session is not None and owner is not session:
                    return None
                _remove_hook(model, key)
                held = owner
        for block in _compat.decoder_layers(model):
            for key, hook in list(block._forward_pre_hooks.items()):
                if isinstance(hook, partial) and hook.func is _record_hidden:
                    _remove_hook(block, key)
        return held


def _remove_hook(module: nn.Module, key: int) -> None:
    """Remove forward pre-hook ``key`` of ``module`` (what its `RemovableHandle` would do)."""
    module._forward_pre_hooks.pop(key, None)
    module._forward_pre_hooks_with_kwargs.pop(key, None)


def _resolve_page_size(page_size: int | None, kv: KVSelector | None) -> int:
    wanted = getattr(kv, "page_size", None) if kv is not None else None
    if page_size is not None:
        check_count(page_size, "page_size", minimum=1)
        if wanted is not None and wanted != page_size:
            raise ValueError(f"page_size={page_size} conflicts with the policy's page={wanted}")
        return page_size
    return wanted or DEFAULT_PAGE_SIZE


def _check_flags(**flags: object) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def _device(device: object) -> torch.device:
    """``device`` as a `torch.device`, or an error naming the argument."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be a torch.device, a device name such as 'cuda:0', or None, got {type(device).__name__}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device={device!r} is not a usable device: {e}") from None


def dynamic_capacity_refused(decoder: Decoder, backend: object = "inductor") -> str | None:
    """Why `Decoder.compile` refuses ``dynamic_capacity=True`` for ``decoder`` and ``backend``, or None."""
    if backend == "inductor" and decoder.device.type == "cuda" and decoder.kv is not None and decoder.kv.two_stage:
        return ("a two-stage policy (rescore > 0) on CUDA: torch 2.11's Inductor fails to generate code for its "
                "second stage under a symbolic cache capacity; compile with a fixed capacity (the default) instead")
    return None


def _check_compile_args(mode: object, dynamic_capacity: object, cuda_graphs: object, backend: object, regional: object) -> None:
    if mode is not None:
        if not isinstance(mode, str):
            raise TypeError(f"mode must be a torch.compile mode name or None, got {type(mode).__name__}")
        try:
            torch._inductor.list_mode_options(mode)
        except RuntimeError as e:
            raise ValueError(f"mode: {e}") from None
    _check_flags(dynamic_capacity=dynamic_capacity)
    for name, value in (("cuda_graphs", cuda_graphs), ("regional", regional)):
        if value is not None:
            _check_flags(**{name: value})
    backends = torch._dynamo.list_backends(exclude_tags=())
    if isinstance(backend, str) and backend not in backends:
        raise ValueError(f"backend must be one of {', '.join(backends)} or a callable, got {backend!r}")
    if not isinstance(backend, str) and not callable(backend):
        raise TypeError(f"backend must be a torch.compile backend name or a callable, got {type(backend).__name__}")


def _eos_ids(model: nn.Module, eos_token_id: int | list[int] | None, vocab: int) -> list[int]:
    """The EOS ids to stop at: ``eos_token_id`` (an int or a list of ints), else the model's
    generation config's, else its config's; each checked against the vocabulary."""
    given = eos_token_id is not None
    if eos_token_id is None:
        cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    where = "eos_token_id" if given else "the model's eos_token_id"
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not all(is_token(i) for i in ids):
        raise TypeError(f"{where} must be an int or a list of ints, got {eos_token_id!r}")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"{where}: {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return list(ids)


def _pad_id(model: nn.Module, pad_token_id: int | None, eos: list[int], vocab: int) -> int:
    """The id finished rows get: ``pad_token_id``, else the config's, else the first EOS id, else 0."""
    given = pad_token_id is not None
    pad = pad_token_id if given else getattr(model.config, "pad_token_id", None)
    if pad is None:
        return eos[0] if eos else 0
    where = "pad_token_id" if given else "the model's pad_token_id"
    if not is_token(pad):
        raise TypeError(f"{where} must be an int, got {pad!r}")
    if not 0 <= pad < vocab:
        raise ValueError(f"{where}: {pad} is outside the vocabulary (0..{vocab - 1})")
    return pad



def attention_of(policy: KVSelector) -> str:
    """The attention of the model a KV policy serves (`KVSelector.attention`), checked."""
    attention = policy.attention
    if attention not in ATTENTIONS:
        raise ValueError(f"{type(policy).__name__}.attention must be 'softmax' or 'entmax', got {attention!r}")
    return attention
