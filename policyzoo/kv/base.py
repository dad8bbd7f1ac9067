"""What every KV policy is and sees: `KVSelector` (the protocol a policy declares and implements),
`KVState` (one layer of the cache, as a policy sees it), budgets and parameter checks, and the files
policies save. The pieces a policy composes in `select` live beside it: `scoring` (scores, bounds,
GQA aggregation, sinks/window and page budgets) and `choose` (the top-k chooser and second stages).

Everything here works on tensors of static shape (the cache capacity, a fixed ``K_max``) and never
synchronises with the host, so a compiled decode step does not recompile as the context grows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

import torch
from torch import Tensor, nn

from .. import kernels
from ..cache import SUMMARIES, PagedKVCache
from ..selection import Selection
from ..workers import Workers
from .context import ContextStore, StepContext

Aggregate = Literal["sum", "max"]


@dataclass
class KVState:
    """What a policy sees of one layer: the cache, visibility, the softmax scale, the policies'
    states for this layer (`layer_state_of`) and the step context (`context`)."""

    cache: PagedKVCache
    layer: int
    scale: float
    # Each policy's state for this layer and request, by policy (`layer_state_of`); the session
    # clears them before each request.
    layer_states: dict[int, Any] = field(default_factory=dict)
    contexts: ContextStore | None = field(default=None, repr=False)  # the session's; None: standalone
    # The kernels' scratch buffers for this device (`kernels.Workspace`); None: each launch makes its own.
    workspace: kernels.Workspace | None = field(default=None, repr=False)
    # Worker processes for a policy's CPU work (`policyzoo.workers`), the session's; None: this process.
    workers: Workers | None = field(default=None, repr=False)

    @property
    def context(self) -> StepContext:
        """This layer's `StepContext` (step index, previous selections, hidden state, request state).

        A state made outside a decode session (tests, a hand-driven cache) gets one of its own, at
        step 0 with nothing recorded.
        """
        if self.contexts is None:
            self.contexts = ContextStore(self.cache.num_layers, self.cache.device)
        return self.contexts.view(self.layer)

    def layer_state_of(self, policy: KVSelector) -> Any:
        """``policy``'s state for this layer and request (`KVSelector.new_layer_state`), made on first
        use and kept across steps."""
        state = self.layer_states.get(id(policy))
        if state is None:
            state = self.layer_states[id(policy)] = policy.new_layer_state()
        return state

    def share_layer_state(self, policy: KVSelector, owner: KVSelector) -> None:
        """Let ``policy`` read ``owner``'s state for this layer (a copy of ``owner`` with another
        budget that scores from the same prefill, as `Certified` keeps)."""
        self.layer_states[id(policy)] = self.layer_state_of(owner)

    def request_for(self, policy: KVSelector) -> object | None:
        """``context.request``: ``policy``'s state for this request (`KVSelector.new_request`). A
        session makes it before each prefill; a state made outside one (tests, a hand-driven cache)
        makes it here on first use."""
        contexts = self.contexts
        if contexts is None:
            contexts = self.contexts = ContextStore(self.cache.num_layers, self.cache.device)
        if contexts.request is None:
            contexts.request = policy.new_request()
        return contexts.request

    @property
    def keys(self) -> Tensor:
        return self.cache.keys[self.layer]

    @property
    def values(self) -> Tensor:
        return self.cache.values[self.layer]

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def token_valid(self) -> Tensor:
        return self.cache.token_valid()

    def page_valid(self) -> Tensor:
        return self.cache.page_counts() > 0

    def num_valid(self) -> Tensor:
        """``int64[B]``: visible tokens per row."""
        return (self.cache.length - self.cache.start).clamp(min=0)


class KVSelector:
    """Base class of KV policies.

    Life cycle per layer: `prefill` once after the dense prefill, `select` every decode step (after
    the step's token is written), `append` after each write.

    What a policy needs and offers is declared here, once, as class attributes (or properties where it
    depends on the policy's parameters); the session, the compiler and the audit read these and
    nothing else, and a wrapper (`kv.wrapper.PolicyWrapper`) derives each from the policy it wraps.
    """

    # The cache page size the policy needs (``None``: any).
    page_size: int | None = None
    # The page summaries `select` reads (names from `cache.SUMMARIES`): the Decoder's cache keeps
    # and refreshes only these. All of them unless a policy says otherwise, so that a policy written
    # before this attribute existed still finds what it reads.
    summaries: tuple[str, ...] = SUMMARIES
    # The parts of the step context `select` reads beyond the step index and the request state
    # (`kv.context.PARTS`: "previous", "below", "hidden", "rotary"); the session keeps only these.
    step_context: tuple[str, ...] = ()
    # The slot multiple a prompt's end is placed on (``None``: the page size), so that the units a
    # policy chooses group the same tokens of a row in any batch (`DecodeSession.prompt_slot`).
    slot_alignment: int | None = None
    # The attention of the model the policy serves: "softmax", or "entmax" (1.5-entmax models; the
    # attention function then attends with entmax in prefill and decode).
    attention: Literal["softmax", "entmax"] = "softmax"
    # Whether `prefill` builds per-request state the decode steps need: such a policy cannot start
    # from a dense prefix computed elsewhere (`DecodeSession.load_prefix`), and its prompt is
    # prefilled in one forward (its prefill sees the whole prompt). Undeclared, a policy that
    # overrides `prefill` is taken to have one (the safe side); the built-ins declare it.
    @property
    def own_prefill(self) -> bool:
        return type(self).prefill is not KVSelector.prefill

    # Whether selections carry ``log_weight`` (sampling corrections): a certificate, which needs the
    # unweighted normaliser, cannot take them.
    weighted: bool = False
    # Whether `select` at layer l also makes layer l+1's selection and hands it over through the step
    # context (`Forecast`): it must then run exactly once per layer and step, in layer order, so a
    # wrapper that runs it twice, skips it or changes its budget by layer cannot take it.
    selects_ahead: bool = False
    # Whether `select` depends on its layer only through the layer's tensors (not through
    # ``state.layer`` or per-layer constants of its own): one compiled decoder layer can then serve
    # every layer (`policyzoo.regional`). A subclass whose `select` reads ``state.layer`` sets False.
    layer_invariant: bool = False
    # Whether the policy rescores candidates exactly in a second stage (``rescore`` > 0).
    two_stage: bool = False
    # Whether `select` reads the cache's geometry alone (its lengths, starts and pages), never the
    # layer's keys, summaries, query or state: its selection is then the same in every layer of a
    # step, so a decode step makes it once, before the layers, and every layer attends through it
    # (`ContextStore.share`), which spares each layer the kernels that build it. That call's query
    # has no heads (``[B, 0, D]``): only its batch and device may be read. A subclass whose own
    # `select` reads more (or records anything) is not: `Dense` and `Window` declare it only for
    # their own `select`.
    same_every_layer: bool = False

    def new_request(self) -> object | None:
        """A fresh state object for one request (one batch of sequences), shared by every layer as
        ``state.context.request``: the session makes it before each prefill and drops it with the
        request. A typed object (a dataclass), not a dict of string keys; ``None`` (the default):
        the policy keeps no state across layers. Tensors in it follow the step context's rule: made
        in `prefill` (eager), updated in place."""
        return None

    def new_layer_state(self) -> Any:
        """A fresh state object for one layer of one request (a dataclass of the policy's own), kept
        across steps and read as ``state.layer_state_of(self)``; the session drops it with the
        request. ``None`` (the default): the policy keeps no per-layer state. Tensors in it follow the
        step context's rule: made in `prefill` (eager), updated in place."""
        return None

    def reset_random(self) -> None:
        """Restart the policy's random stream from its seed (a policy that samples), so that a
        request's draws do not depend on the requests before it; nothing for the others."""

    def attach(self, model: nn.Module) -> None:
        """Called once when a Decoder takes the policy for ``model`` (before it moves the policy's
        learned parts to the model's device): a policy that builds or checks something against the
        model's weights or shapes does it here (`Forecast` starts its heads from the model's)."""

    def prefill(self, state: KVState, q: Tensor, k: Tensor, v: Tensor) -> None:
        """Called once per layer after the dense prefill; ``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]``."""

    def finish_prefill(self, states: Sequence[KVState]) -> None:
        """Complete the prefill of ``states`` (layers whose `prefill` has run) before their first
        `select`. The session calls it once after the prompt's forward, with every layer's state (and
        for one layer at once where a select follows its prefill directly): a policy whose prefill
        hands work to other processes (`CommunityKV`'s graph partitions) waits for it here, so the
        work of all layers runs at once, beside the forward."""

    def select(self, state: KVState, q: Tensor) -> Selection:
        """Return the entries the query ``q [B, H, D]`` attends to."""
        raise NotImplementedError  # abstract

    def append(self, state: KVState, k: Tensor, v: Tensor) -> None:
        """Called after each decode token is written (the cache keeps page summaries itself)."""

    # ----------------------------------------------------------- the next layer's selection
    # A policy whose `select` at layer l already makes layer l+1's selection says so here; an
    # offloaded layer l+1 then fetches those pages while layer l runs (`offload.PageCache.prefetch`).

    def predicts_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s selection is made while layer ``layer - 1`` selects (fixed per
        layer: a compiled step decides by it)."""
        return False

    def next_layer_selection(self, state: KVState, sel: Selection) -> Selection | None:
        """Layer ``state.layer + 1``'s selection at this step, after this layer's `select` returned
        ``sel``: a selection wherever `predicts_layer(state.layer + 1)`, else ``None``."""
        return None

    # ------------------------------------------------------------------ learned parameters
    # A policy may own parameters: any attribute that is an `nn.Module` (a scoring head, say). The
    # Decoder moves them to the model's device and dtype; `save` and `load` keep them in a
    # safetensors file together with the policy's parameters (its dataclass fields).

    def modules(self) -> dict[str, nn.Module]:
        """The policy's learned parts: its attributes that are `nn.Module`s, by name."""
        return {name: value for name, value in vars(self).items() if isinstance(value, nn.Module)}

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every learned parameter (none for a policy without modules)."""
        for module in self.modules().values():
            yield from module.parameters()

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "KVSelector":
        """Move the learned parts (floating-point tensors take ``dtype``); returns the policy."""
        for module in self.modules().values():
            module.to(device=device, dtype=dtype)
        return self

    def state_dict(self) -> dict[str, Tensor]:
        """``{"<module>.<name>": tensor}`` of every learned part."""
        return {f"{name}.{key}": value for name, module in self.modules().items() for key, value in module.state_dict().items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> "KVSelector":
        """Load `state_dict` output into the learned parts, strictly: every key, every shape."""
        modules = self.modules()
        owner = type(self).__name__
        unknown = sorted({key.split(".", 1)[0] for key in state} - set(modules))
        if unknown:
            raise ValueError(f"{owner} has no learned part {unknown[0]!r} (its parts: {sorted(modules) or 'none'})")
        for name, module in modules.items():
            part = {key.split(".", 1)[1]: value for key, value in state.items() if key.split(".", 1)[0] == name}
            try:
                module.load_state_dict(part, strict=True)
            except RuntimeError as e:
                raise ValueError(f"{owner}.{name}: the saved tensors do not fit ({e})") from None
        return self

    def save(self, path: str | Path) -> Path:
        """Write the learned parts and the policy's parameters to a safetensors file."""
        from safetensors.torch import save_file

        if not self.modules():
            raise ValueError(f"{type(self).__name__} has no learned parameters to save")
        tensors = {key: value.detach().contiguous().cpu() for key, value in self.state_dict().items()}
        meta = {"policy": type(self).__name__, "params": json.dumps(policy_params(self))}
        save_file(tensors, str(path), metadata=meta)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "KVSelector":
        """A policy of this class built with the parameters saved in ``path`` (``overrides`` replace
        some, e.g. the budget), its learned parts loaded from the file."""
        meta, tensors = read_policy_file(path, cls.__name__)
        params = {**json.loads(meta.get("params", "{}")), **overrides}
        return cls(**params).load_state_dict(tensors)


def read_policy_file(path: str | Path, owner: str) -> tuple[dict[str, str], dict[str, Tensor]]:
    """``(metadata, tensors)`` of a policy file that `KVSelector.save` (or a subclass's) wrote for
    class ``owner``; a clear error for a missing file or another policy's."""
    from ..files import read_safetensors

    meta, tensors = read_safetensors(path, "no policy file", f"is not a safetensors file written by {owner}.save")
    if meta.get("policy") != owner:
        what = f"a {meta['policy']} policy" if "policy" in meta else f"{meta['kind']!r} data" if "kind" in meta else "no policyzoo policy"
        raise ValueError(f"{str(path)!r} holds {what}, not {owner}")
    return meta, tensors


def policy_params(policy: KVSelector) -> dict[str, Any]:
    """A policy's JSON-ready parameters: its dataclass fields that the constructor takes."""
    if not is_dataclass(policy):
        return {}
    out = {}
    for f in fields(policy):
        value = getattr(policy, f.name)
        if f.init and isinstance(value, (bool, int, float, str, type(None), list, tuple)):
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


# ------------------------------------------------------------------------------------ budgets
@dataclass(frozen=True)
class Budget:
    """A number of tokens (``int > 0``) or a keep ratio of the visible context (``float in (0, 1]``)."""

    value: int | float

    def __post_init__(self) -> None:
        check_budget(self.value, "budget")

    @property
    def is_ratio(self) -> bool:
        return isinstance(self.value, float)

    def k_max(self, capacity: int) -> int:
        """Static selection width for a cache of ``capacity`` entries."""
        if self.is_ratio:
            return max(1, min(capacity, math.ceil(self.value * capacity - 1e-9)))
        return max(1, min(capacity, int(self.value)))

    def count(self, n_valid: Tensor) -> Tensor:
        """Entries to keep given ``n_valid`` visible entries (a tensor; no host sync)."""
        if self.is_ratio:
            # The epsilon absorbs float error (0.07 * 100 is 7.000000000000001, which must keep 7).
            return torch.ceil(n_valid.double() * self.value - 1e-9).long()
        return torch.full_like(n_valid, int(self.value))


# The largest token count a policy parameter may hold: far beyond any context, and small enough that
# position arithmetic on it (``start + sinks``, ``length - window``) cannot overflow int64.
MAX_COUNT = 2**62


def check_budget(value: object, name: str) -> None:
    """Raise a clear error unless ``value`` is a positive token count or a keep ratio in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an int (tokens) or a float keep ratio, got {type(value).__name__}")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ValueError(f"{name} as a keep ratio must be in (0, 1], got {value}")
    if isinstance(value, int) and not 0 < value <= MAX_COUNT:
        raise ValueError(f"{name} must be a positive number of tokens (at most 2**62), got {value}")


def check_count(value: object, name: str, minimum: int = 0, maximum: int | None = MAX_COUNT) -> None:
    """Raise a clear error unless ``value`` is an int in ``[minimum, maximum]`` (``None``: no maximum)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {'2**62' if maximum == MAX_COUNT else maximum}, got {value}")
