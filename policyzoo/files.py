"""Reading the safetensors files policyzoo writes (policies, calibrated sparsifiers), with errors
that name the file: a missing one, or one that is not a safetensors file at all."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor


def read_safetensors(path: str | Path, missing: str, not_one: str) -> tuple[dict[str, str], dict[str, Tensor]]:
    """``(metadata, tensors)`` of the safetensors file ``path``. ``missing`` and ``not_one`` start the
    messages for a path that is no file (`FileNotFoundError`) and a file that is not safetensors
    (`ValueError`); both end with the path."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{missing} {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own (Rust) errors for a file that is not one
        raise ValueError(f"{str(path)!r} {not_one} ({e})") from None


__all__ = ["read_safetensors"]
