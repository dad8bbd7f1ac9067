"""Projection sparsifiers: keep only the largest input activations of chosen linear layers in decode.

A sparsifier decides *which* input features each decode token keeps (`keep_mask`); `SparseLinear`
wraps an `nn.Linear` and, in decode, computes the projection over the kept features only through
`kernels.sparse_linear` (a sparse GEMV that reads only the kept weight columns). Prefill stays dense.

On the kernel path, projections that read the same input (q/k/v, gate/up: `_compat.SHARED_INPUT`)
form a `SharedInput` group: one GEMM over their concatenated input-major weights computes all of
them when they run dense (prefill, dense decoding: `fuse_shared_inputs` groups them for a Decoder
without a sparsifier too), and one sparse GEMV computes them in sparse decoding
(`ProjectionSparsifier.project_group`): one selection where the kept set depends on the input alone
(`ProjectionSparsifier.input_only`, e.g. `TopK`), per-column thresholds for `Threshold`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from .. import kernels
from .._compat import PROJECTIONS, SHARED_INPUT, decoder_layers

ALL_TARGETS = tuple(PROJECTIONS)


@dataclass
class ProjectionSwitch:
    """What the projection wrappers of one Decoder read as a forward runs: whether this forward
    computes the sparse projections (``sparse``: a decode step of a setting with sparse projections)
    and the audit recorder, if any (``recorder``, with a ``record_projection(name, keep)`` method).

    The Decoder makes one and hands it to the wrappers it installs (`ProjectionSparsifier.install`);
    its session is the one writer, and sets it only around the forwards it drives, so the wrappers
    compute dense projections whenever no policyzoo decode step is running."""

    sparse: bool = False
    recorder: Any = None


def check_keep(keep: object, name: str = "keep") -> float:
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise TypeError(f"{name} must be a float keep ratio in (0, 1], got {type(keep).__name__}")
    if not 0.0 < float(keep) <= 1.0:
        raise ValueError(f"{name} must be a keep ratio in (0, 1], got {keep}")
    return float(keep)


def check_targets(targets: Sequence[str]) -> tuple[str, ...]:
    if isinstance(targets, str) or not isinstance(targets, (tuple, list, set, frozenset)):
        raise TypeError(f"targets must be a tuple of projection names such as ('gate', 'up', 'down'), got {targets!r}")
    targets = tuple(targets)
    bad = [t for t in targets if not isinstance(t, str) or t not in PROJECTIONS]
    if bad or not targets:
        raise ValueError(f"targets must be a non-empty subset of {list(PROJECTIONS)}, got {list(targets)}")
    return targets


class ProjectionSparsifier:
    """Base class: `keep_mask(name, x)` says which input features of projection ``name`` to keep.

    ``name`` is ``"<layer>.<target>"`` (e.g. ``"3.down"``); ``x`` is ``[..., d_in]``.
    """

    keep: float
    targets: tuple[str, ...]
    # True when `keep_mask` ignores ``name``: projections of one input can then share a selection.
    input_only: bool = False
    # True when it decodes a tensor-parallel model (`policyzoo.distributed`): it keeps, on a rank's
    # shard of a row-parallel projection's input, the features one process keeps.
    shardable: bool = False
    # True when what it keeps depends on the layer only through the layer's tensors (no per-layer
    # constants): one compiled decoder layer can then serve every layer (`policyzoo.regional`).
    layer_invariant: bool = False

    def keep_mask(self, name: str, x: Tensor) -> Tensor:
        raise NotImplementedError  # abstract

    def project(self, name: str, x: Tensor, w_t: Tensor, bias: Tensor | None, *,
                workspace: kernels.Workspace | None = None) -> Tensor:
        """The sparse projection of ``x [B, d_in]`` through input-major ``w_t`` (the kernel path;
        ``workspace``: the kernels' scratch, `kernels.Workspace`).

        Subclasses override it with a cheaper way to name the kept features (an index list, an
        in-kernel threshold); the default goes through the mask.
        """
        keep = self.keep_mask(name, x)
        return kernels.sparse_linear(x, w_t.t(), bias, keep, workspace=workspace)

    def project_group(
        self, names: Sequence[str], sizes: Sequence[int], x: Tensor, w_t: Tensor, bias: Tensor | None, *,
        workspace: kernels.Workspace | None = None,
    ) -> Tensor | None:
        """The sparse projections ``names`` of one input ``x [B, d_in]`` in one pass over their
        concatenated input-major weights ``w_t [d_in, Σ sizes]``, or None where each member must run
        its own. Input-only sparsifiers share one kept set; others override this where they can."""
        return self.project(names[0], x, w_t, bias, workspace=workspace) if self.input_only else None

    def install(self, model: nn.Module, switch: ProjectionSwitch, workspace: kernels.Workspace | None = None) -> None:
        """Replace the target linears of every decoder layer by `SparseLinear` wrappers, and group
        the projections of a shared input (`fuse_shared_inputs`). The wrappers pass ``workspace``
        (the kernels' scratch; on CUDA one made here when none is given) to the sparse GEMV."""
        param = next(model.parameters())
        if workspace is None and param.is_cuda and kernels.use_triton(param):  # eager, before any graph is recorded
            workspace = kernels.Workspace(param.device)
        for i, layer in enumerate(decoder_layers(model)):
            _wrap(layer, i, self.targets, switch, self, workspace)
        fuse_shared_inputs(model, switch, workspace)


def fuse_shared_inputs(model: nn.Module, switch: ProjectionSwitch, workspace: kernels.Workspace | None = None) -> None:
    """Group q/k/v and gate/up of every layer into `SharedInput`s on the kernel path.

    Projections not wrapped yet are wrapped dense (no sparsifier). A group forms only when its
    members share one sparsifier (or none): a projection sparsified alone keeps its own GEMV. Where
    the dense GEMV kernel takes decode rows (`kernels.dense_gemv_decode_rows`), the other
    projections (o, down) not sparsified and the LM head become `DenseDecodeLinear`s, so that their
    decode rows reach it too.
    """
    if not kernels.use_triton(next(model.parameters())):
        return  # the reference path keeps the model's own linears
    alone = [t for t in PROJECTIONS if not any(t in group for group in SHARED_INPUT)]
    rows = kernels.dense_gemv_decode_rows()
    for i, layer in enumerate(decoder_layers(model)):
        for target in alone if rows else ():
            parent_name, linear_name = PROJECTIONS[target]
            linear = getattr(getattr(layer, parent_name), linear_name)
            if not isinstance(linear, SparseLinear):
                setattr(getattr(layer, parent_name), linear_name, DenseDecodeLinear(linear, rows, workspace))
        for group in SHARED_INPUT:
            _wrap(layer, i, [t for t in group if not isinstance(_linear(layer, t), SparseLinear)], switch, None, workspace)
            members = [_linear(layer, t) for t in group]
            same = all(m.sparsifier is members[0].sparsifier for m in members)
            if same and all(m.w_t is not None and m.group is None for m in members):
                SharedInput(members)
    head = _output_embedding(model)
    if rows and type(head) is nn.Linear:  # the same weight, tied or not: the wrapper holds the linear
        model.set_output_embeddings(DenseDecodeLinear(head, rows, workspace))


def shared_groups(model: nn.Module, sparsifier: "ProjectionSparsifier | None" = None) -> list["SharedInput"]:
    """The `SharedInput` groups of ``model`` (those of ``sparsifier`` only, when given), in layer order."""
    groups: list[SharedInput] = []
    for module in model.modules():
        if isinstance(module, SparseLinear) and module.group is not None and module.group.members[0] is module:
            if sparsifier is None or module.sparsifier is sparsifier:
                groups.append(module.group)
    return groups


def group_segment(sizes: Sequence[int]) -> int:
    """The widest run of columns on which every member boundary of a group falls: ``gcd(sizes)``."""
    return math.gcd(*sizes)


def _output_embedding(model: nn.Module) -> nn.Module | None:
    """The model's LM head (a Hugging Face model's output embedding), or None."""
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _linear(layer: nn.Module, target: str) -> nn.Module:
    parent_name, linear_name = PROJECTIONS[target]
    return getattr(getattr(layer, parent_name), linear_name)


def _wrap(
    layer: nn.Module, i: int, targets: Sequence[str], switch: ProjectionSwitch, sparsifier: "ProjectionSparsifier | None",
    workspace: kernels.Workspace | None = None,
) -> None:
    for target in targets:
        parent_name, linear_name = PROJECTIONS[target]
        parent = getattr(layer, parent_name)
        linear = getattr(parent, linear_name)
        if isinstance(linear, (SparseLinear, DenseDecodeLinear)):
            linear = linear.linear
        setattr(parent, linear_name, SparseLinear(linear, f"{i}.{target}", sparsifier, switch, workspace))


def uninstall(model: nn.Module) -> None:
    """Put back the original linears, weights in their original layout (a no-op where nothing was wrapped)."""
    head = _output_embedding(model)
    if isinstance(head, DenseDecodeLinear):
        model.set_output_embeddings(head.linear)
    for layer in decoder_layers(model):
        for parent_name, linear_name in PROJECTIONS.values():
            parent = getattr(layer, parent_name)
            linear = getattr(parent, linear_name)
            if isinstance(linear, DenseDecodeLinear):
                setattr(parent, linear_name, linear.linear)
            elif isinstance(linear, SparseLinear):
                if not linear.linear.weight.is_contiguous():  # an input-major view made at wrap time
                    linear.linear.weight = nn.Parameter(linear.linear.weight.contiguous(), requires_grad=False)
                setattr(parent, linear_name, linear.linear)


class DenseDecodeLinear(nn.Module):
    """A dense `nn.Linear` whose inputs of up to ``rows`` rows (decode) go through the dense GEMV
    kernel (`kernels.dense_gemv`, over the weight in its own output-major layout), larger ones (a
    prompt) through the linear itself (cuBLAS). ``workspace``: the kernels' scratch. It reads as the
    linear it wraps (``weight``, ``bias``, the feature counts, and writes to them go to it): code
    that looks at or ties a model's output embedding while a Decoder holds the model sees the linear."""

    def __init__(self, linear: nn.Linear, rows: int, workspace: kernels.Workspace | None = None) -> None:
        super().__init__()
        self.linear = linear
        self.rows = rows
        self.workspace = workspace

    @property
    def weight(self) -> Tensor:
        return self.linear.weight

    @property
    def bias(self) -> Tensor | None:
        return self.linear.bias

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("weight", "bias", "in_features", "out_features"):  # e.g. tying the output embedding to the input's
            setattr(self.linear, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() <= self.rows * x.shape[-1]:
            return kernels.dense_gemv(x, self.linear.weight, self.linear.bias, workspace=self.workspace)
        return self.linear(x)


class SparseLinear(nn.Module):
    """An `nn.Linear` that reads only the kept input features during decode (with a sparsifier), or
    a dense member of a `SharedInput` group (``sparsifier=None``).

    Where the sparse GEMV kernel runs (CUDA), the weight is stored input-major once, at wrap time:
    ``w_t [d_in, d_out]``, so each kept input feature is one contiguous row read. The linear's own
    weight becomes a transposed view of it (same values, no second copy; dense matmuls take either
    layout). Its dense projection of up to ``dense_rows`` rows (`kernels.dense_gemv_decode_rows`,
    read here) goes through the dense GEMV kernel, larger ones through the linear (cuBLAS).
    """

    def __init__(self, linear: nn.Linear, name: str, sparsifier: ProjectionSparsifier | None, switch: ProjectionSwitch,
                 workspace: kernels.Workspace | None = None) -> None:
        super().__init__()
        self.linear = linear
        self.name = name
        self.sparsifier = sparsifier
        self.switch = switch
        self.workspace = workspace  # the kernels' scratch for the sparse GEMV (None: made per call)
        w_t = None
        if kernels.use_triton(linear.weight):
            w_t = linear.weight.detach().t().contiguous()  # no copy when the weight already is such a view
            linear.weight = nn.Parameter(w_t.t(), requires_grad=False)
        self.register_buffer("w_t", w_t, persistent=False)
        self.dense_rows = kernels.dense_gemv_decode_rows() if w_t is not None else 0
        self.group: SharedInput | None = None

    def sparse_now(self) -> bool:
        """Whether this call computes the sparse projection (decode, with sparse projections on)."""
        return self.sparsifier is not None and self.switch.sparse

    def forward(self, x: Tensor) -> Tensor:
        if not self.sparse_now():
            if self.group is not None:
                y = self.group.output(self, x)
                return y.view(*x.shape[:-1], y.shape[-1])
            if self.w_t is not None and x.numel() <= self.dense_rows * x.shape[-1]:
                return kernels.dense_gemv_t(x, self.w_t, self.linear.bias, workspace=self.workspace)
            return self.linear(x)
        if self.switch.recorder is not None:
            self.switch.recorder.record_projection(self.name, self.sparsifier.keep_mask(self.name, x))
        if self.w_t is None:
            keep = self.sparsifier.keep_mask(self.name, x)
            return kernels.sparse_linear(x, self.linear.weight, self.linear.bias, keep, workspace=self.workspace)
        if self.group is not None:
            y = self.group.output(self, x)
        else:
            y = self.sparsifier.project(self.name, x.reshape(-1, x.shape[-1]), self.w_t, self.linear.bias,
                                        workspace=self.workspace)
        return y.view(*x.shape[:-1], y.shape[-1])


class SharedInput:
    """Projections that read one input, computed together: one dense GEMM, or, in sparse decoding,
    one sparse GEMV (`ProjectionSparsifier.project_group`: one selection for an input-only
    sparsifier, per-column thresholds for `Threshold`; a sparsifier that cannot serve the group in
    one pass runs each member's own).

    The members' input-major weights are concatenated once into ``w_t [d_in, Σ d_out]``; each
    member's ``w_t`` and ``linear.weight`` become views of it (no second copy). The first member
    called with a new input computes every member's output and keeps them until each member has
    taken its own; the identity check on the input makes a member called with any other tensor
    recompute rather than reuse. Nothing is left pending between forwards, so a compiled step sees
    the same state (and guards) every time.
    """

    def __init__(self, members: list[SparseLinear]) -> None:
        self.members = members
        self.names = [m.name for m in members]
        self.sizes = [m.w_t.shape[1] for m in members]
        self.w_t = torch.cat([m.w_t for m in members], dim=1).contiguous()
        biases = [m.linear.bias for m in members]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b.detach() if b is not None else self.w_t.new_zeros(n) for b, n in zip(biases, self.sizes)])
        offset = 0
        for m, n in zip(members, self.sizes):
            m.w_t = self.w_t[:, offset : offset + n]
            m.linear.weight = nn.Parameter(m.w_t.t(), requires_grad=False)
            m.group = self
            offset += n
        self.dense_rows = members[0].dense_rows  # rows up to which the dense GEMM is the dense GEMV kernel
        self._input: Tensor | None = None
        self._outputs: tuple[Tensor, ...] = ()
        self._pending = 0

    def output(self, member: SparseLinear, x: Tensor) -> Tensor:
        """``member``'s output ``[N, d_out]`` for input ``x [..., d_in]``."""
        x2 = x.reshape(-1, x.shape[-1])
        if self._input is not x:
            first = self.members[0]
            if member.sparse_now():
                y = first.sparsifier.project_group(self.names, self.sizes, x2, self.w_t, self.bias,
                                                   workspace=first.workspace)
                if y is None:  # the sparsifier cannot serve the group in one pass
                    return member.sparsifier.project(member.name, x2, member.w_t, member.linear.bias,
                                                     workspace=member.workspace)
            elif x2.shape[0] <= self.dense_rows:
                y = kernels.dense_gemv_t(x2, self.w_t, self.bias, workspace=self.members[0].workspace)
            else:
                y = torch.nn.functional.linear(x2, self.w_t.t(), self.bias)
            self._input, self._outputs, self._pending = x, y.split(self.sizes, dim=-1), len(self.members)
        out = self._outputs[self.members.index(member)]
        self._pending -= 1
        if self._pending == 0:
            self._input, self._outputs = None, ()
        return out


def kept_features(keep: float, d: int) -> int:
    """``ceil(keep·d)``, at least 1 (the small epsilon absorbs float error such as 0.3·10)."""
    return max(1, min(d, math.ceil(keep * d - 1e-9)))


def topk_mask(x: Tensor, keep: float) -> Tensor:
    """``bool`` mask of the ``ceil(keep·d)`` largest-magnitude features of each row of ``x``."""
    d = x.shape[-1]
    k = kept_features(keep, d)
    idx = x.abs().topk(k, dim=-1).indices
    return torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)
