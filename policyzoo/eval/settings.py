"""The evaluation grid's settings: (KV policy × projection sparsifier) pairs built from spec strings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from .. import assets
from ..kv.base import KVSelector


@dataclass
class Setting:
    """One grid point: a KV policy (``None``: dense) and a projection sparsifier (``None``: dense)."""

    label: str
    kv: KVSelector | None
    proj: Any
    kv_spec: str = "dense"
    proj_spec: str = "none"


def make_settings(kv_specs: Sequence[str], proj_specs: Sequence[str]) -> list[Setting]:
    """Every ``kv × proj`` pair of specs (`policyzoo.spec`), in the given order (kv outer)."""
    from ..spec import parse_kv, parse_proj, spec_label

    projs = {spec: parse_proj(spec) for spec in proj_specs}  # one instance per spec (calibrated once)
    settings, seen = [], set()
    for kv_spec in kv_specs:
        for proj_spec in proj_specs:
            label = spec_label(kv_spec, proj_spec)
            if label in seen:
                raise ValueError(f"setting {label!r} appears twice in the grid")
            seen.add(label)
            settings.append(Setting(label, parse_kv(kv_spec), projs[proj_spec], kv_spec, proj_spec))
    return settings


def calibrate_thresholds(model: Any, tokenizer: Any, settings: Iterable[Setting], tokens: int = 4096) -> None:
    """Calibrate every uncalibrated `Threshold` of ``settings`` on the first ``tokens`` essay tokens,
    and say so on stderr (the Python API refuses an uncalibrated `Threshold`; the command line, given
    ``threshold:KEEP`` without ``path=``, calibrates it on the essays)."""
    import sys

    from ..proj import Threshold

    todo = [s for s in settings if isinstance(s.proj, Threshold) and not s.proj.thresholds]
    if not todo:
        return
    for s in todo:
        print(f"calibrating {s.proj_spec} on the first {tokens} essay tokens (no path= given; "
              "`policyzoo calibrate` writes a file to reuse)", file=sys.stderr)
    todo = [s.proj for s in todo]
    ids = torch.tensor(tokenizer(assets.essays_text()[: tokens * 6], add_special_tokens=False).input_ids[:tokens])
    chunks = [ids[i : i + 1024] for i in range(0, len(ids), 1024)]
    for proj in todo:
        proj.calibrate(model, chunks)


def setting_record(s: Setting) -> dict:
    """The JSON record of a setting: its label, specs and the repr of its policies."""
    return {"label": s.label, "kv": s.kv_spec, "proj": s.proj_spec, "kv_policy": repr(s.kv), "proj_policy": repr(s.proj)}
