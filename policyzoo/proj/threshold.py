"""`Threshold`: TEAL-style activation sparsity with per-projection magnitude thresholds.

`calibrate` runs the dense model over real text, collects each target projection's input magnitudes
and sets its threshold at the ``1 − keep`` quantile of ``|x|`` (equivalently the
``0.5 + 0.5·(1 − keep)`` quantile of a symmetric ``x``), so that on similar text about ``keep`` of the
inputs survive. In decode, inputs with ``|x| >= threshold`` are kept; the kept fraction varies per
token, which is the point (and the reason to audit it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from .. import kernels
from .._compat import PROJECTIONS, check_supported, decoder_layers
from .base import ALL_TARGETS, ProjectionSparsifier, check_keep, check_targets

if TYPE_CHECKING:
    from ..runtime import Runtime

_SAMPLES_PER_PROJECTION = 1 << 18  # enough for a stable quantile, small enough for any model


@dataclass
class Threshold(ProjectionSparsifier):
    """Keep inputs whose magnitude reaches the calibrated per-projection threshold."""

    keep: float = 0.5
    targets: Sequence[str] = ALL_TARGETS
    thresholds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keep = check_keep(self.keep)
        self.targets = check_targets(self.targets)
        if not isinstance(self.thresholds, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in self.thresholds.items()
        ):
            raise TypeError(f"thresholds must be a dict {{'<layer>.<target>': number}}, got {self.thresholds!r}")
        bad = [k for k, v in self.thresholds.items() if not math.isfinite(v)]
        if bad:
            raise ValueError(f"thresholds[{bad[0]!r}] must be a finite number, got {self.thresholds[bad[0]]}")
        self._cache: dict[str, Tensor] = {}

    def threshold(self, name: str, device: torch.device) -> Tensor:
        """Projection ``name``'s threshold as a 0-dim fp32 tensor on ``device``: the one `install`
        made, or (used outside a Decoder) one made now."""
        t = self._cache.get(name)
        if t is not None and t.device == device:
            return t
        if name not in self.thresholds:
            raise ValueError(f"Threshold has no threshold for projection {name!r}: call calibrate() or load() first")
        t = self._cache[name] = torch.tensor(self.thresholds[name], device=device, dtype=torch.float32)
        return t

    def install(self, model: nn.Module, runtime: "Runtime") -> None:
        """Wrap the projections and make every calibrated threshold a device tensor, once.

        A compiled step must not make them: a tensor created inside a step that CUDA graphs replay
        is overwritten by the next replay. `calibrate` later updates these tensors in place.
        """
        device = next(model.parameters()).device
        for name, value in self.thresholds.items():
            t = self._cache.get(name)
            if t is None or t.device != device:
                t = self._cache[name] = torch.tensor(value, device=device, dtype=torch.float32)
                if device.type == "cuda":
                    torch._dynamo.mark_static_address(t)
        super().install(model, runtime)

    def keep_mask(self, name: str, x: Tensor) -> Tensor:
        return x.abs().float() >= self.threshold(name, x.device)

    def project(self, name: str, x: Tensor, w_t: Tensor, bias: Tensor | None) -> Tensor:
        return kernels.sparse_gemv_threshold(x, self.threshold(name, x.device), w_t, bias)

    @torch.no_grad()
    def calibrate(
        self,
        model: nn.Module,
        texts: Sequence[str] | Sequence[Tensor],
        tokenizer=None,
        max_tokens: int = 1024,
        progress: bool = False,
    ) -> "Threshold":
        """Set thresholds from the dense model's activations on ``texts`` (strings need ``tokenizer``;
        each is cut to ``max_tokens``), with a progress bar over the texts if ``progress``."""
        check_supported(model)
        if len(texts) == 0:
            raise ValueError("texts must hold at least one text")
        samples: dict[str, list[Tensor]] = {}
        hooks = []
        for i, layer in enumerate(decoder_layers(model)):
            for target in self.targets:
                parent, linear = PROJECTIONS[target]
                module = getattr(getattr(layer, parent), linear)
                name = f"{i}.{target}"
                hooks.append(module.register_forward_pre_hook(_collector(samples.setdefault(name, []))))
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
        g = torch.Generator().manual_seed(0)
        for name, chunks in samples.items():
            mags = torch.cat(chunks)
            if mags.numel() > _SAMPLES_PER_PROJECTION:
                mags = mags[torch.randperm(mags.numel(), generator=g)[:_SAMPLES_PER_PROJECTION]]
            self.thresholds[name] = float(torch.quantile(mags, 1.0 - self.keep)) if self.keep < 1 else 0.0
            if name in self._cache:  # in place: an installed, compiled step keeps reading this tensor
                self._cache[name].fill_(self.thresholds[name])
        return self

    def save(self, path: str | Path) -> Path:
        """Write the thresholds (one scalar tensor per projection) and ``keep`` to a safetensors file;
        returns its path."""
        if not self.thresholds:
            raise ValueError("nothing to save: calibrate() first")
        tensors = {name: torch.tensor([t], dtype=torch.float32) for name, t in self.thresholds.items()}
        save_file(tensors, str(path), metadata={"keep": repr(self.keep), "targets": ",".join(self.targets)})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "Threshold":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if "keep" not in meta:
            raise ValueError(f"{path} is not a policyzoo Threshold file (no 'keep' metadata)")
        tensors = load_file(str(path))
        return cls(
            keep=float(meta["keep"]),
            targets=tuple(meta["targets"].split(",")),
            thresholds={k: float(v[0]) for k, v in tensors.items()},
        )


def _collector(store: list[Tensor]):
    def hook(module: nn.Module, args: tuple) -> None:
        x = args[0].detach().abs().float().flatten()
        if x.numel() > _SAMPLES_PER_PROJECTION:
            x = x[:: x.numel() // _SAMPLES_PER_PROJECTION + 1]
        store.append(x.cpu())

    return hook
