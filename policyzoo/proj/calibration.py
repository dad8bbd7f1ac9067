"""What calibrated sparsifiers (`Threshold`, fast `TopK`) share: running the dense model over text
to collect each target projection's inputs, per-projection scalars kept as device tensors, and
their safetensors files.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from .._compat import PROJECTIONS, check_supported, decoder_layers
from ..files import read_safetensors
from ..distributed import shard_of


def check_values(values: object, what: str) -> None:
    """``values`` must be a ``{'<layer>.<target>': finite number}`` dict."""
    if not isinstance(values, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in values.items()
    ):
        raise TypeError(f"{what} must be a dict {{'<layer>.<target>': number}}, got {values!r}")
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{what}[{bad[0]!r}] must be a finite number, got {values[bad[0]]}")


def check_fits(values: dict[str, float], model: nn.Module, targets: Sequence[str], owner: str, what: str) -> None:
    """Calibrated ``values`` (when there are any) must name exactly the target projections of
    ``model``'s layers: values calibrated for another model (another depth, other targets) are refused
    when the sparsifier is installed, not used where the names happen to match."""
    if not values:
        return  # not calibrated yet: `calibrate` may follow the install
    layers = len(decoder_layers(model))
    wanted = {f"{i}.{t}" for i in range(layers) for t in targets}
    extra, missing = sorted(set(values) - wanted), sorted(wanted - set(values))
    if extra or missing:
        found = f"names {extra[0]!r}, which this model does not have" if extra else f"lacks {missing[0]!r}"
        raise ValueError(
            f"{owner}: the {what} do not fit this model ({layers} layers, targets {'+'.join(targets)}): the file or dict "
            f"{found}; they were calibrated for another model. Calibrate on this one (calibrate(model, texts)) or load its own file"
        )


def read_values(path: str | Path, kind: str, owner: str, label: str) -> tuple[dict[str, str], dict[str, float]]:
    """``(metadata, values)`` of a file that `save_values` wrote for ``kind`` (``threshold``,
    ``topk-fast``; ``label`` names it in messages), with an error naming the file for a missing file,
    one that is not safetensors, or one of another kind (a policy's, another sparsifier's)."""
    try:
        meta, tensors = read_safetensors(path, f"{owner}.load: no file", "is not a safetensors file")
    except ValueError as e:
        raise ValueError(f"{owner}.load: {e}") from None
    if "keep" not in meta or meta.get("kind", "threshold") != kind:
        other = meta.get("policy") or meta.get("kind") or "unknown"
        raise ValueError(f"{owner}.load: {str(path)!r} is not a policyzoo {label} file (it holds {other!r} data)")
    return meta, {k: float(v[0]) for k, v in tensors.items()}


@torch.no_grad()
def collect_inputs(
    model: nn.Module,
    texts: Sequence[str] | Sequence[Tensor],
    targets: Sequence[str],
    summarise: Callable[[Tensor], Tensor],
    tokenizer=None,
    max_tokens: int = 1024,
    progress: bool = False,
) -> dict[str, Tensor]:
    """Run the dense ``model`` over ``texts`` (strings need ``tokenizer``; each is cut to
    ``max_tokens``) and return, per projection ``"<layer>.<target>"``, the concatenation of
    ``summarise(x)`` over its inputs ``x [tokens, d_in]`` (on the CPU)."""
    part = shard_of(model)
    if part is not None and part.world > 1:
        raise ValueError("calibrate the model before sharding it (policyzoo.distributed.shard): a rank sees shards of some inputs")
    check_supported(model)
    if len(texts) == 0:
        raise ValueError("texts must hold at least one text")
    samples: dict[str, list[Tensor]] = {}
    hooks = []

    def collector(store: list[Tensor]):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            store.append(summarise(x.reshape(-1, x.shape[-1])).cpu())

        return hook

    for i, layer in enumerate(decoder_layers(model)):
        for target in targets:
            parent, linear = PROJECTIONS[target]
            module = getattr(getattr(layer, parent), linear)
            hooks.append(module.register_forward_pre_hook(collector(samples.setdefault(f"{i}.{target}", []))))
    try:
        device = next(model.parameters()).device
        for text in tqdm(texts, desc="calibrate", unit="text", disable=not progress):
            if isinstance(text, str):
                if tokenizer is None:
                    raise ValueError("texts are strings: pass the model's tokenizer")
                ids = tokenizer(text, return_tensors="pt").input_ids
            else:
                ids = torch.as_tensor(text).reshape(1, -1)
            model(input_ids=ids[:, :max_tokens].to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {name: torch.cat(chunks) for name, chunks in samples.items()}


class DeviceScalars:
    """Per-projection scalars (``values``, a dict the sparsifier owns) as fp32 device tensors.

    `install` makes them once, before any compiled step: a tensor made inside a step that CUDA
    graphs replay is overwritten by the next replay. `refresh` writes new values into the same
    tensors, so an installed, compiled step keeps reading them. `columns` is one tensor per group
    of projections computed in one pass: each member's value repeated over its output columns.
    """

    def __init__(self, values: dict[str, float], what: str, missing_hint: str) -> None:
        self.values, self.what, self.missing_hint = values, what, missing_hint
        self._scalars: dict[str, Tensor] = {}
        self._columns: dict[tuple[str, ...], tuple[tuple[int, ...], Tensor]] = {}

    def scalar(self, name: str, device: torch.device) -> Tensor:
        """Projection ``name``'s value, 0-dim on ``device``: the installed one, or (used outside a
        Decoder) one made now."""
        t = self._scalars.get(name)
        if t is not None and t.device == device:
            return t
        if name not in self.values:
            raise ValueError(f"no {self.what} for projection {name!r}: {self.missing_hint}")
        t = self._scalars[name] = torch.tensor(self.values[name], device=device, dtype=torch.float32)
        return t

    def columns(self, names: tuple[str, ...]) -> Tensor | None:
        """The installed ``[1, Σ d_out]`` tensor of a group, or None."""
        entry = self._columns.get(names)
        return entry[1] if entry is not None else None

    def install(self, device: torch.device, groups: Sequence[tuple[tuple[str, ...], tuple[int, ...]]] = ()) -> None:
        """Make the device tensors of every known value, and of each group ``(names, sizes)`` whose
        members all have one, where not made yet (made ones keep their identity: `refresh` updates
        their values)."""
        for name in self.values:
            t = self._scalars.get(name)
            if t is None or t.device != device:
                self._scalars[name] = _static(torch.tensor(self.values[name], device=device, dtype=torch.float32))
        for names, sizes in groups:
            made = self._columns.get(names)
            if all(n in self.values for n in names) and (made is None or made[1].device != device):
                self._columns[names] = (sizes, _static(self._expand(names, sizes, device)))

    def refresh(self) -> None:
        """Write ``values`` into the tensors made so far, in place."""
        for name, t in self._scalars.items():
            if name in self.values:
                t.fill_(self.values[name])
        for names, (sizes, t) in self._columns.items():
            t.copy_(self._expand(names, sizes, t.device))

    def _expand(self, names: tuple[str, ...], sizes: tuple[int, ...], device: torch.device) -> Tensor:
        values = torch.tensor([self.values[n] for n in names], dtype=torch.float32)
        return values.repeat_interleave(torch.tensor(sizes))[None, :].to(device)


def _static(t: Tensor) -> Tensor:
    if t.device.type == "cuda":
        torch._dynamo.mark_static_address(t)
    return t


def save_values(path: str | Path, values: dict[str, float], metadata: dict[str, str]) -> Path:
    """One fp32 scalar tensor per projection, and ``metadata``, to a safetensors file."""
    tensors = {name: torch.tensor([v], dtype=torch.float32) for name, v in values.items()}
    save_file(tensors, str(path), metadata=metadata)
    return Path(path)


def load_values(path: str | Path) -> tuple[dict[str, str], dict[str, float]]:
    """``(metadata, values)`` of a file `save_values` wrote."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return meta, {k: float(v[0]) for k, v in load_file(str(path)).items()}


__all__ = ["check_values", "collect_inputs", "DeviceScalars", "save_values", "load_values"]
