"""`Gate`: per request, the setting with the least predicted decode time within a quality budget.

A Decoder built with a KV policy and a projection sparsifier can decode a request in four settings:

- ``dense``: every KV page, dense projections;
- ``proj``: every KV page, sparse projections (the saving is fixed per step);
- ``kv``: the KV policy, dense projections (the saving grows with the context);
- ``both``: the KV policy and sparse projections.

Which is fastest depends on the context (the byte account's crossover, `policyzoo.bytes`) and on
the device, so the gate measures it: `Gate.calibrate` times a few decode steps of each setting at a
few contexts on the current device and keeps one step-time curve per setting (ms per step versus
context: linear between the measured contexts, extrapolated beyond the last one along the line
through the last two). A quality budget, a maximum perplexity increase over dense with a table of
measured increases per setting (`load_quality` reads the evaluation harness's JSON), excludes the
settings that lose too much; ``dense`` is always allowed. `Gate.choose` returns the allowed setting
with the least predicted step time at a context; `Gate.explain` says why.

    gate = Gate.calibrate(model, kv=Quest(0.2), proj=TopK(0.5), contexts=[1024, 4096, 16384, 65536])
    gate.set_quality({"dense": 0.0, "proj": 0.4, "kv": 0.01, "both": 0.5}, max_ppl_increase=0.45)
    gate.save("gate.json")
    dec = Decoder(model, kv=Quest(0.2), proj=TopK(0.5), gate=Gate.load("gate.json"))
    dec.generate(ids, max_new_tokens=64); dec.last_choice   # e.g. "kv"

The gate file is JSON (``format``, ``device``, ``kv``, ``proj``, ``curves``, ``quality``,
``max_ppl_increase``, ``meta``); the curves are ``{setting: {context: ms}}``.
"""

from __future__ import annotations

import bisect
import datetime as dt
import json
import math
import numbers
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from .bytes import SETTINGS, format_context
from .synthetic import fill_random
from .timing import time_step

FORMAT = "policyzoo-gate/1"
DEFAULT_CONTEXTS = (1024, 4096, 16384, 65536)


# ------------------------------------------------------------------------------------ helpers
def device_name(device: torch.device | str) -> str:
    """A device's name as the gate records it: the CUDA device name (``"NVIDIA H200"``) or the type (``"cpu"``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def spec(policy: Any) -> str | None:
    """The string a gate records for a KV policy or projection sparsifier (its ``repr``; ``None`` for none)."""
    return None if policy is None else repr(policy)


def _check_setting(setting: object, what: str = "setting") -> str:
    if setting not in SETTINGS:
        raise ValueError(f"{what} must be one of {', '.join(SETTINGS)}, got {setting!r}")
    return setting  # type: ignore[return-value]


def _check_context(context: object) -> float:
    if isinstance(context, bool) or not isinstance(context, numbers.Real) or not (math.isfinite(context) and context >= 1):
        raise ValueError(f"context must be a number of tokens >= 1, got {context!r}")
    return float(context)


def _finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _curve(setting: str, points: object) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``{context: ms}`` or ``[(context, ms), ...]`` -> sorted ``(contexts, ms)``, checked."""
    items = points.items() if isinstance(points, Mapping) else points
    try:
        pairs = [(c, m) for c, m in items]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"curves[{setting!r}] must map contexts to ms per step ({{4096: 7.0, ...}}), got {points!r}") from None
    out: dict[int, float] = {}
    for c, m in pairs:
        try:
            n = int(c) if isinstance(c, str) else c
        except ValueError:
            n = c
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"curves[{setting!r}]: context {c!r} is not a positive whole number of tokens")
        if int(n) in out:
            raise ValueError(f"curves[{setting!r}]: context {int(n)} appears twice")
        ms = _finite(m, f"curves[{setting!r}][{int(n)}] (ms per step)")
        if ms <= 0:
            raise ValueError(f"curves[{setting!r}][{int(n)}]: ms per step must be > 0, got {ms}")
        out[int(n)] = ms
    if len(out) < 2:
        raise ValueError(f"curves[{setting!r}] needs at least two contexts (it extrapolates from the last two), got {len(out)}")
    contexts = tuple(sorted(out))
    return contexts, tuple(out[c] for c in contexts)


def load_quality(
    source: str | Path | Mapping[str, Any] | Sequence[Mapping[str, Any]],
    names: Mapping[str, str] | None = None,
    *,
    kv_spec: str | None = None,
    proj_spec: str | None = None,
) -> dict[str, float]:
    """Perplexity increase per gate setting, from an evaluation results file or records.

    ``source`` is a path to a JSON file, or the parsed JSON: a list of records, or an object whose
    ``"rows"`` (or ``"results"``) is that list, or a plain ``{"dense": 0.0, "kv": 0.01, ...}``. Each record has ``"setting"`` (a label) and
    ``"ppl_increase"`` (a number; records without it, or with ``null``, such as passkey rows, are
    skipped). Labels are the gate settings themselves (``dense``, ``proj``, ``kv``, ``both``) unless
    ``names`` maps a gate setting to the label the file uses, e.g.
    ``{"kv": "quest:budget=0.25", "proj": "topk:0.5", "both": "quest:budget=0.25 + topk:0.5"}``.
    Where several records name one setting (several lengths or texts), the largest increase counts.
    Labels that name no gate setting are ignored.

    ``policyzoo eval`` results (``results.json``) also list their ``"settings"`` with ``label``,
    ``kv_policy`` and ``proj_policy`` (the policies' ``repr``); given the gate's ``kv_spec`` and
    ``proj_spec`` (a gate passes its own), the labels are matched to gate settings through them
    when ``names`` is not given: ``kv`` is the row whose KV policy is ``kv_spec`` and whose
    projections are dense, ``both`` the one with both, and so on (``Dense()`` and ``None`` are
    dense).
    """
    for s in names or {}:
        _check_setting(s, "names key")
    where = "quality"
    if isinstance(source, (str, Path)):
        where = str(source)
        try:
            source = json.loads(Path(source).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
    label_of = {s: s for s in SETTINGS}
    if names is None and isinstance(source, Mapping) and isinstance(source.get("settings"), Sequence):
        label_of.update(_names_from_settings(source["settings"], kv_spec, proj_spec))
    label_of.update(names or {})
    setting_of = {label: s for s, label in label_of.items()}
    records = source
    if isinstance(source, Mapping) and "rows" not in source and "results" not in source and source and set(source) <= set(SETTINGS):
        return _check_quality(source)  # a plain {setting: ppl increase} table
    if isinstance(source, Mapping):
        records = source.get("rows", source.get("results"))
        if records is None:
            raise ValueError(f"{where}: expected a list of records or an object with 'rows' (records with 'setting' and 'ppl_increase')")
    if not isinstance(records, Sequence) or isinstance(records, (str, bytes)):
        raise ValueError(f"{where}: expected a list of records with 'setting' and 'ppl_increase', got {type(records).__name__}")
    quality: dict[str, float] = {}
    for i, r in enumerate(records):
        if not isinstance(r, Mapping) or "setting" not in r:
            raise ValueError(f"{where}: record {i} has no 'setting'")
        value = r.get("ppl_increase")
        setting = setting_of.get(r["setting"])
        if value is None or setting is None:
            continue
        value = _finite(value, f"{where}: record {i} ppl_increase")
        quality[setting] = max(value, quality.get(setting, -math.inf))
    return quality


def _names_from_settings(settings: Sequence[Any], kv_spec: str | None, proj_spec: str | None) -> dict[str, str]:
    """Gate setting -> eval label, matching each eval setting's policies against the gate's specs."""
    dense_kv, dense_proj = ("Dense()", "None", None), ("None", None)
    names: dict[str, str] = {}
    for rec in settings:
        if not isinstance(rec, Mapping) or "label" not in rec:
            continue
        kv, proj = rec.get("kv_policy"), rec.get("proj_policy")
        kv_match = "dense" if kv in dense_kv else ("kv" if kv_spec is not None and kv == kv_spec else None)
        proj_match = "dense" if proj in dense_proj else ("proj" if proj_spec is not None and proj == proj_spec else None)
        if kv_match is None or proj_match is None:
            continue
        setting = {("dense", "dense"): "dense", ("dense", "proj"): "proj", ("kv", "dense"): "kv", ("kv", "proj"): "both"}[(kv_match, proj_match)]
        names.setdefault(setting, rec["label"])
    return names


def _check_quality(quality: Mapping[str, Any]) -> dict[str, float]:
    if not isinstance(quality, Mapping):
        raise ValueError(f"quality must be a dict {{setting: ppl increase}} or a results file, got {type(quality).__name__}")
    return {_check_setting(s, "quality key"): _finite(v, f"quality[{s!r}]") for s, v in quality.items()}


# ------------------------------------------------------------------------------------ decision
@dataclass(frozen=True)
class GateDecision:
    """What `Gate.explain` returns: the choice at one context and why.

    ``predicted_ms`` holds the predicted ms per step of every calibrated setting (excluded ones too);
    ``excluded`` maps each setting that could not be chosen to the reason.
    """

    context: float
    choice: str
    predicted_ms: dict[str, float]
    excluded: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        k = f" ({format_context(int(self.context))})" if self.context >= 1024 else ""
        lines = [f"gate at context {self.context:g} tokens{k}: {self.choice}"]
        for s in SETTINGS:
            ms = self.predicted_ms.get(s)
            cell = f"{ms:9.3f} ms" if ms is not None else f"{'—':>9}   "
            status = "chosen" if s == self.choice else (f"excluded: {self.excluded[s]}" if s in self.excluded else "slower")
            lines.append(f"  {s:<6} {cell}  {status}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------ the gate
class Gate:
    """Choose, per request, among ``dense`` / ``proj`` / ``kv`` / ``both`` the fastest allowed setting.

    Args:
        curves: per setting, measured ms per decode step at two or more contexts:
            ``{"dense": {4096: 7.0, 32768: 15.4}, "kv": {...}, ...}`` (or lists of ``(context, ms)``
            pairs). ``dense`` is required; a setting without a curve is never chosen.
        quality: measured perplexity increase over dense per setting (a dict such as
            ``{"dense": 0.0, "proj": 0.4, "kv": 0.01, "both": 0.5}``, or an eval results file: see
            `load_quality`; a `policyzoo eval` results file is matched to the settings through
            ``kv_spec`` and ``proj_spec``).
        names: gate setting -> label used by a results file, where its labels are not the settings'.
        max_ppl_increase: the quality budget. Settings whose increase exceeds it, or that have no
            measurement, are never chosen; ``dense`` is always allowed. ``None``: no budget.
        device: the device the curves were measured on (`device_name`).
        kv_spec, proj_spec: the KV policy and projection sparsifier they were measured with (`spec`).
        meta: anything else worth keeping in the file (dates, versions, calibration parameters).

    Prediction (`predict`): linear interpolation in context between measured points; beyond the last
    point the line through the last two (its slope floored at 0: a step never gets cheaper with more
    context); below the first point the first point's value. Ties go to the earlier setting of
    ``dense, proj, kv, both``.
    """

    def __init__(
        self,
        curves: Mapping[str, Any],
        *,
        quality: str | Path | Mapping[str, Any] | None = None,
        max_ppl_increase: float | None = None,
        names: Mapping[str, str] | None = None,
        device: str | None = None,
        kv_spec: str | None = None,
        proj_spec: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(curves, Mapping) or not curves:
            raise ValueError("curves must be a non-empty dict {setting: {context: ms per step}}")
        self.curves = {_check_setting(s, "curves key"): _curve(s, pts) for s, pts in curves.items()}
        if "dense" not in self.curves:
            raise ValueError("curves must include 'dense' (always allowed, the fallback)")
        for name, value in (("device", device), ("kv_spec", kv_spec), ("proj_spec", proj_spec)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string or None, got {type(value).__name__}")
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a dict or None, got {type(meta).__name__}")
        self.device, self.kv_spec, self.proj_spec = device, kv_spec, proj_spec
        self.meta = dict(meta or {})
        self.quality: dict[str, float] | None = None
        self.max_ppl_increase: float | None = None
        self.set_quality(quality, max_ppl_increase, names)

    def set_quality(
        self,
        quality: str | Path | Mapping[str, Any] | None,
        max_ppl_increase: float | None = None,
        names: Mapping[str, str] | None = None,
    ) -> "Gate":
        """Set the quality table and budget (see the class arguments); returns the gate."""
        if quality is None:
            table = None
        elif isinstance(quality, (str, Path, Sequence)) or (isinstance(quality, Mapping) and ("rows" in quality or "results" in quality)):
            table = load_quality(quality, names, kv_spec=self.kv_spec, proj_spec=self.proj_spec)
        elif names is not None:
            raise ValueError("names maps the labels of a results file; a plain {setting: ppl increase} dict needs none")
        else:
            table = _check_quality(quality)
        if max_ppl_increase is not None:
            budget = _finite(max_ppl_increase, "max_ppl_increase")
            if budget < 0:
                raise ValueError(f"max_ppl_increase must be >= 0, got {budget}")
            if table is None:
                raise ValueError("max_ppl_increase needs a quality table (measured ppl increase per setting)")
            max_ppl_increase = budget
        self.quality, self.max_ppl_increase = table, max_ppl_increase
        return self

    # -------------------------------------------------------------------------- prediction
    @property
    def settings(self) -> tuple[str, ...]:
        """The calibrated settings, in the order ``dense, proj, kv, both``."""
        return tuple(s for s in SETTINGS if s in self.curves)

    def predict(self, setting: str, context: float) -> float:
        """Predicted ms per decode step of ``setting`` at ``context`` tokens."""
        _check_setting(setting)
        n = _check_context(context)
        if setting not in self.curves:
            raise ValueError(f"setting {setting!r} was not calibrated (calibrated: {', '.join(self.settings)})")
        xs, ys = self.curves[setting]
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            return ys[-1] + slope * (n - xs[-1])
        i = bisect.bisect_right(xs, n)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def explain(self, context: float, available: Iterable[str] | None = None) -> GateDecision:
        """The choice at ``context`` with every setting's predicted ms per step and the exclusions.

        ``available`` restricts the settings (a Decoder without a KV policy offers only ``dense`` and
        ``proj``); ``dense`` must be among them.
        """
        n = _check_context(context)
        offered = set(SETTINGS) if available is None else {_check_setting(s, "available setting") for s in available}
        if "dense" not in offered:
            raise ValueError("available settings must include 'dense'")
        predicted = {s: self.predict(s, n) for s in self.settings}
        excluded: dict[str, str] = {}
        for s in SETTINGS:
            if s not in self.curves:
                excluded[s] = "not calibrated"
            elif s not in offered:
                excluded[s] = "not available (the Decoder lacks its KV policy or projection sparsifier)"
            elif s != "dense" and self.max_ppl_increase is not None:
                q = (self.quality or {}).get(s)
                if q is None:
                    excluded[s] = f"no perplexity measurement (budget {self.max_ppl_increase:g})"
                elif q > self.max_ppl_increase:
                    excluded[s] = f"ppl increase {q:g} > budget {self.max_ppl_increase:g}"
        allowed = [s for s in self.settings if s not in excluded]
        choice = min(allowed, key=lambda s: (predicted[s], SETTINGS.index(s)))
        return GateDecision(n, choice, predicted, excluded)

    def choose(self, context: float, available: Iterable[str] | None = None) -> str:
        """The allowed setting with the least predicted step time at ``context`` (see `explain`)."""
        return self.explain(context, available).choice

    def warn_if_mismatched(self, kv: Any, proj: Any, device: torch.device | str) -> None:
        """Warn when a Decoder's policies or device differ from those the gate was calibrated with."""
        here = {"kv": spec(kv), "proj": spec(proj), "device": device_name(device)}
        there = {"kv": self.kv_spec, "proj": self.proj_spec, "device": self.device}
        for key in ("kv", "proj", "device"):
            if there[key] is not None and here[key] is not None and here[key] != there[key]:
                warnings.warn(f"gate was calibrated with {key} {there[key]!r}, not {here[key]!r}: its predictions may not hold", stacklevel=3)

    def __repr__(self) -> str:
        budget = "" if self.max_ppl_increase is None else f", max_ppl_increase={self.max_ppl_increase:g}"
        return f"Gate(settings={list(self.settings)}, device={self.device!r}{budget})"

    # -------------------------------------------------------------------------- files
    def to_dict(self) -> dict:
        """The JSON-ready content of a gate file."""
        return {
            "format": FORMAT,
            "device": self.device,
            "kv": self.kv_spec,
            "proj": self.proj_spec,
            "curves": {s: {str(c): m for c, m in zip(*self.curves[s])} for s in self.settings},
            "quality": self.quality,
            "max_ppl_increase": self.max_ppl_increase,
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> Path:
        """Write the gate as JSON to ``path``; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> "Gate":
        """A gate from `to_dict`'s content."""
        if not isinstance(record, Mapping) or record.get("format") != FORMAT:
            found = record.get("format") if isinstance(record, Mapping) else type(record).__name__
            raise ValueError(f"not a gate file: expected format {FORMAT!r}, found {found!r}")
        if "curves" not in record:
            raise ValueError("gate file has no 'curves'")
        return cls(
            record["curves"], quality=record.get("quality"), max_ppl_increase=record.get("max_ppl_increase"),
            device=record.get("device"), kv_spec=record.get("kv"), proj_spec=record.get("proj"), meta=record.get("meta"),
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> "Gate":
        """Read a gate written by `save`."""
        try:
            record = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a gate file (not JSON: {e})") from None
        try:
            return cls.from_dict(record)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    # -------------------------------------------------------------------------- calibration
    @classmethod
    def calibrate(
        cls,
        model: Any,
        kv: Any = None,
        proj: Any = None,
        contexts: Sequence[int] = DEFAULT_CONTEXTS,
        steps: int = 8,
        *,
        reps: int = 3,
        warmup: int = 2,
        batch: int = 1,
        settings: Sequence[str] | None = None,
        compile: bool = False,
        page_size: int | None = None,
        quality: str | Path | Mapping[str, Any] | None = None,
        max_ppl_increase: float | None = None,
        names: Mapping[str, str] | None = None,
        progress: bool = True,
        seed: int = 0,
    ) -> "Gate":
        """Measure step-time curves on the model's device with a short timing sweep.

        For each context and setting the Decoder's session starts a sequence batch of random keys
        and values (`synthetic.fill_random`: timing does not depend on their values for fixed
        budgets; a policy that builds state in its own prefill gets it from random queries), then
        times ``reps`` times ``steps`` decode steps from that context after ``warmup`` steps
        (`timing.time_step`: the shared timer, CUDA events on CUDA, the wall clock
        elsewhere); the curve point is the median of the per-step means. The steps run the way a
        gated `Decoder` runs them: one Decoder with ``kv`` and ``proj`` installed, switched per
        setting with `Decoder.use`; with ``compile=True``, through the compiled step as `generate`
        replays it. ``settings`` defaults to those ``kv`` / ``proj`` make possible; ``dense`` is
        always timed. The model's projection wrappers are removed afterwards.

        ``model`` may also be a `Decoder` (then give no ``kv``, ``proj``, ``page_size`` or
        ``compile``): its own policies and step are timed (a compiled step is compiled once for
        calibration and later decoding alike) and its setting is restored afterwards.
        """
        from .decoder import Decoder
        from .proj.base import uninstall

        for name, value, low in (("steps", steps, 1), ("reps", reps, 1), ("warmup", warmup, 0), ("batch", batch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if isinstance(contexts, (str, bytes)) or not isinstance(contexts, Sequence):
            raise ValueError(f"contexts must be a list of token counts, got {contexts!r}")
        for c in contexts:
            if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1:
                raise ValueError(f"contexts must be positive ints, got {c!r}")
        contexts = sorted({int(c) for c in contexts})
        if len(contexts) < 2:
            raise ValueError("contexts: give at least two (each curve extrapolates from its last two points)")
        if isinstance(model, Decoder):
            if kv is not None or proj is not None or page_size is not None or compile:
                raise ValueError("calibrating a Decoder: kv, proj, page_size and compile are the Decoder's own; pass none")
            dec, kv, proj, model = model, model.kv, model.proj, model.model
            compile, restore = dec.session.compiled, dec.setting
        else:
            dec, restore = Decoder(model, kv=kv, proj=proj, page_size=page_size, compile=compile), None
        possible = dec.available_settings()
        chosen = list(possible) if settings is None else ["dense"] + [_check_setting(s) for s in settings if s != "dense"]
        missing = [s for s in chosen if s not in possible]
        if missing:
            raise ValueError(f"settings {missing} need {'a KV policy' if 'kv' in missing or 'both' in missing else 'a projection sparsifier'}")
        session, device = dec.session, dec.device
        margin = max(warmup, steps, 3) + 1  # room for the warm-up (and, compiled, the capture) or the timed steps
        gen = torch.Generator(device=device).manual_seed(seed)
        curves: dict[str, dict[int, float]] = {s: {} for s in SETTINGS if s in chosen}
        from tqdm.auto import tqdm

        bar = tqdm(total=len(contexts) * len(curves), desc="gate calibration", disable=not progress, leave=False)
        try:
            for n in contexts:
                for s in curves:
                    bar.set_postfix_str(f"{s} @ {format_context(n)}")
                    session.use(s)
                    # One cache for every context: a compiled step captured on it is replayed at each.
                    fill_random(session, n, batch=batch, capacity=contexts[-1] + margin, generator=gen)
                    curves[s][n] = time_step(session, calls=steps, reps=reps, warmup=warmup)
                    bar.update(1)
        finally:
            bar.close()
            if restore is None:
                uninstall(model)
            else:
                dec.use(restore)
        meta = {
            "date": dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__, "batch": batch,
            "steps": steps, "reps": reps, "warmup": warmup, "compile": compile, "page_size": dec.page_size,
            "dtype": str(dec.dtype).removeprefix("torch."),
        }  # fmt: skip
        return cls(curves, quality=quality, max_ppl_increase=max_ppl_increase, names=names, device=device_name(device),
                   kv_spec=spec(kv), proj_spec=spec(proj), meta=meta)  # fmt: skip
