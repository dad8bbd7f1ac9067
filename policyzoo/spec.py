"""Policy specs: build KV policies and projection sparsifiers from short strings.

A spec is ``NAME`` or ``NAME:PARAMS`` where ``PARAMS`` is a comma-separated list of ``key=value``
pairs; a leading value without a key is the policy's first parameter::

    parse_kv("quest:budget=256,page=16")      # Quest(budget=256, page=16)
    parse_kv("attn-topk:0.25")                # AttentionTopK(budget=0.25)
    parse_kv("window:sinks=4,window=256")     # Window(sinks=4, window=256)
    parse_kv("dense")                         # Dense()
    parse_proj("topk:0.5")                    # TopK(keep=0.5)
    parse_proj("threshold:0.5,path=thr.safetensors")   # Threshold.load("thr.safetensors")
    parse_proj("topk:0.5,mode=fast,path=fast.safetensors")  # TopK.load: the fast mode's ratios
    parse_kv("mine:budget=0.2,path=mine.safetensors")  # a learned policy: MyPolicy.load(path, budget=0.2)
    parse_kv("prhs:[quest:0.1,rescore=3],time=0.9")   # PrHS(Quest(0.1, rescore=3), time=0.9)
    parse_kv("certified:[quest:0.05,bound=sketch],eps=0.05,max_budget=0.3")   # a budget by certified mass
    parse_kv("prhs:path=prhs.safetensors")    # PrHS.load: a calibrated schedule and its wrapped policy
    parse_proj("none")                        # None (dense projections)

Values keep their type as written: ``256`` is an int (a number of tokens), ``0.25`` a float (a keep
ratio), ``true``/``false`` booleans, anything else a string; list parameters (``targets``) join
their items with ``+`` (``topk:0.5,targets=gate+up+down``); a policy that wraps another (`PrHS`)
takes it as a KV spec in brackets (``[quest:0.1,page=16]``). A bad spec raises `ValueError` naming
the accepted policies, or the policy's parameters and defaults.

New policies register in one line: ``KV_POLICIES["mine"] = MyPolicy`` (`policyzoo.kv.registry`) (a dataclass whose fields are
its parameters) or ``PROJ_SPARSIFIERS["mine"] = MySparsifier``. Every KV policy also takes ``path``:
a safetensors file written by `KVSelector.save` (a policy with learned parameters), whose saved
parameters the spec's others replace.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable

from .kv import Dense, KVSelector, PrHS
from .kv.registry import KV_POLICIES
from .proj import ProjectionSparsifier, Threshold, TopK

# name -> class (`kv.registry`, the one registry of KV policies); a class's dataclass fields are its
# spec parameters, in order.
PROJ_SPARSIFIERS: dict[str, type] = {
    "topk": TopK,
    "threshold": Threshold,
}
# names that mean "no policy" (dense decoding for that branch)
KV_DENSE_NAMES = ("dense", "none")
PROJ_NONE_NAMES = ("none", "dense")

# Parameters a spec may not set (internal state) and extra ones handled here.
_HIDDEN = {Threshold: ("thresholds",), TopK: ("ratios",), PrHS: ("depth",)}
_EXTRA = {
    Threshold: {"path": "a safetensors file written by Threshold.save (loads its thresholds)"},
    TopK: {"path": "with mode=fast: a safetensors file written by TopK.save (loads its ratios)"},
    PrHS: {"path": "a safetensors file written by PrHS.save or `policyzoo calibrate --method prhs` (its schedule, groups and wrapped policy)"},
}
# A calibrated sparsifier's field of per-projection values, which `path` loads.
_CALIBRATED = {Threshold: "thresholds", TopK: "ratios"}
_KV_EXTRA = {"path": "a safetensors file written by KVSelector.save (its parameters and learned tensors)"}

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.+-]*$")


def parse_kv(spec: str) -> KVSelector:
    """Build a KV policy from a spec such as ``"quest:budget=256,page=16"`` (``"dense"``: `Dense()`)."""
    name, params = _split(spec, "kv")
    if name.lower() == "none":
        name = "dense"
    cls = _lookup(name, KV_POLICIES, "KV policy", extra_names=("none",))
    kwargs = _kwargs(cls, name, params, spec, extra=("path",))
    path = kwargs.pop("path", None)
    if path is None:
        return _construct(cls, cls, name, kwargs, spec)
    if not Path(str(path)).is_file():
        raise ValueError(f"spec {spec!r}: no policy file {str(path)!r}")
    return _construct(lambda **kw: cls.load(str(path), **kw), cls, name, kwargs, spec)


def parse_proj(spec: str) -> ProjectionSparsifier | None:
    """Build a projection sparsifier from a spec such as ``"topk:0.5"``; ``"none"`` gives ``None``."""
    name, params = _split(spec, "proj")
    if name.lower() in PROJ_NONE_NAMES:
        if params:
            raise ValueError(f"proj spec {spec!r}: {name!r} takes no parameters")
        return None
    cls = _lookup(name, PROJ_SPARSIFIERS, "projection sparsifier", extra_names=PROJ_NONE_NAMES)
    if cls in _CALIBRATED:
        return _build_calibrated(cls, name, params, spec)
    return _build(cls, name, params, spec)


def describe(registry: dict[str, type] | None = None) -> str:
    """One line per registered policy: ``name: param=default, ...`` (both registries by default)."""
    registries = [registry] if registry is not None else [KV_POLICIES, PROJ_SPARSIFIERS]
    return "\n".join(f"{name}: {_params_text(cls)}" for reg in registries for name, cls in reg.items())


def spec_label(kv_spec: str, proj_spec: str) -> str:
    """A setting's label from its two specs: ``"quest:0.25 + topk:0.5"``, ``"dense + topk:0.5"``, ``"dense"``."""
    kv, proj = _normalise(kv_spec), _normalise(proj_spec)
    kv_dense = kv.lower() in KV_DENSE_NAMES
    proj_none = proj.lower() in PROJ_NONE_NAMES
    if proj_none:
        return "dense" if kv_dense else kv
    return f"{'dense' if kv_dense else kv} + {proj}"


# ------------------------------------------------------------------------------------ internals
def _normalise(spec: str) -> str:
    return "".join(str(spec).split())


def _split(spec: object, kind: str) -> tuple[str, list[tuple[str | None, str]]]:
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{kind} spec must be a non-empty string such as {_example(kind)!r}, got {spec!r}")
    text = _normalise(spec)
    name, _, rest = text.partition(":")
    if not _NAME.match(name):
        raise ValueError(f"{kind} spec {spec!r}: bad policy name {name!r}; accepted: {_accepted(kind)}")
    params: list[tuple[str | None, str]] = []
    if rest:
        for i, item in enumerate(_top_level(rest, spec, kind)):
            if not item:
                raise ValueError(f"{kind} spec {spec!r}: empty parameter (stray comma?)")
            key, eq, value = ("", "", item) if item.startswith("[") else item.partition("=")
            if not eq:
                if i != 0:
                    raise ValueError(f"{kind} spec {spec!r}: {item!r} needs a name (key=value); only the first value may be positional")
                params.append((None, item))
            elif not key or not value:
                raise ValueError(f"{kind} spec {spec!r}: bad parameter {item!r} (expected key=value)")
            else:
                params.append((key, value))
    elif ":" in text:
        raise ValueError(f"{kind} spec {spec!r}: nothing after ':'")
    return name, params


def _top_level(rest: str, spec: str, kind: str) -> list[str]:
    """``rest`` split at the commas outside brackets (a bracketed nested spec keeps its own)."""
    items, depth, current = [], 0, ""
    for ch in rest:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            raise ValueError(f"{kind} spec {spec!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise ValueError(f"{kind} spec {spec!r}: unbalanced '['")
    return items + [current]


def _example(kind: str) -> str:
    return "quest:budget=256,page=16" if kind == "kv" else "topk:0.5"


def _accepted(kind: str) -> str:
    if kind == "kv":
        return ", ".join(list(KV_POLICIES) + ["none"])
    return ", ".join(list(PROJ_SPARSIFIERS) + list(PROJ_NONE_NAMES))


def _lookup(name: str, registry: dict[str, type], what: str, extra_names: tuple[str, ...] = ()) -> type:
    lowered = {k.lower(): v for k, v in registry.items()}
    lowered.update({cls.__name__.lower(): cls for cls in registry.values()})  # class names work too
    cls = lowered.get(name.lower())
    if cls is None:
        lines = "\n".join(f"  {n}: {_params_text(c)}" for n, c in registry.items())
        accepted = ", ".join(list(registry) + list(extra_names))
        raise ValueError(f"unknown {what} {name!r}; accepted: {accepted}\n{lines}")
    return cls


def _fields(cls: type) -> list[dataclasses.Field]:
    if not dataclasses.is_dataclass(cls):
        return []
    hidden = _HIDDEN.get(cls, ())
    return [f for f in dataclasses.fields(cls) if f.init and f.name not in hidden]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _show(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "+".join(map(str, value))
    if value is dataclasses.MISSING:
        return "(required)"
    return str(value)


def _params_text(cls: type) -> str:
    parts = [f"{f.name}={_show(_default(f))}" for f in _fields(cls)]
    extra = _EXTRA.get(cls, _KV_EXTRA if isinstance(cls, type) and issubclass(cls, KVSelector) and cls is not Dense else {})
    parts += [f"{k} ({doc})" for k, doc in extra.items()]
    return ", ".join(parts) if parts else "(no parameters)"


def _convert(text: str, default: Any) -> Any:
    """A spec value with its written type: int, float, bool, a ``+``-joined list, a bracketed KV
    spec (the policy it builds), or a string."""
    if text.startswith("[") and text.endswith("]"):
        return parse_kv(text[1:-1])
    if isinstance(default, (tuple, list)):
        return tuple(_convert(item, None) for item in text.split("+") if item)
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+|\d+\.?\d*[eE][+-]?\d+)", text):
        return float(text)
    return text


def _kwargs(cls: type, name: str, params: list[tuple[str | None, str]], spec: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    fields = _fields(cls)
    by_name = {f.name: f for f in fields}
    usage = f"{name} parameters: {_params_text(cls)}"
    kwargs: dict[str, Any] = {}
    for key, value in params:
        if key is None:
            if not fields:
                raise ValueError(f"spec {spec!r}: {name} takes no parameters")
            key = fields[0].name
        if key not in by_name and key not in extra:
            raise ValueError(f"spec {spec!r}: unknown parameter {key!r}; {usage}")
        if key in kwargs:
            raise ValueError(f"spec {spec!r}: parameter {key!r} given twice; {usage}")
        kwargs[key] = _convert(value, _default(by_name[key]) if key in by_name else None)
    return kwargs


def _construct(factory: Callable[..., Any], cls: type, name: str, kwargs: dict[str, Any], spec: str) -> Any:
    try:
        return factory(**kwargs)
    except (TypeError, ValueError, OSError) as e:  # OSError: a file a parameter names (heads=, path=)
        raise ValueError(f"spec {spec!r}: {e}; {name} parameters: {_params_text(cls)}") from None


def _build(cls: type, name: str, params: list[tuple[str | None, str]], spec: str) -> Any:
    return _construct(cls, cls, name, _kwargs(cls, name, params, spec), spec)


def _build_calibrated(cls: type, name: str, params: list[tuple[str | None, str]], spec: str) -> ProjectionSparsifier:
    """`Threshold` or `TopK`, with ``path=FILE`` loading the per-projection values `save` wrote."""
    kwargs = _kwargs(cls, name, params, spec, extra=("path",))
    path = kwargs.pop("path", None)
    if path is None:
        return _construct(cls, cls, name, kwargs, spec)  # a calibrated mode needs calibrate() before use
    if not Path(str(path)).is_file():
        raise ValueError(f"spec {spec!r}: no {name} file {str(path)!r}")
    try:
        loaded = cls.load(str(path))
    except ValueError as e:
        raise ValueError(f"spec {spec!r}: {e}") from None
    values = getattr(loaded, _CALIBRATED[cls])
    keep = kwargs.pop("keep", None)
    if keep is not None and abs(float(keep) - loaded.keep) > 1e-9:
        raise ValueError(f"spec {spec!r}: keep={keep} but {path} was calibrated for keep={loaded.keep}")
    if "mode" in kwargs and kwargs["mode"] != getattr(loaded, "mode", None):
        raise ValueError(f"spec {spec!r}: mode={kwargs['mode']} but {path} holds mode={loaded.mode}'s ratios")
    if "targets" in kwargs:
        kwargs["targets"] = tuple(kwargs["targets"])
        missing = [t for t in kwargs["targets"] if not any(n.endswith("." + t) for n in values)]
        if missing:
            raise ValueError(f"spec {spec!r}: {path} has no {_CALIBRATED[cls]} for targets {missing}")
    fixed = {f.name: getattr(loaded, f.name) for f in dataclasses.fields(loaded) if f.name not in ("targets",)}
    fixed.update({_CALIBRATED[cls]: dict(values)})
    return _construct(
        lambda **kw: cls(**{**fixed, "targets": loaded.targets, **kw}), cls, name, kwargs, spec,
    )  # fmt: skip
