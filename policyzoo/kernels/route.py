"""The one rule that sends a call to an op's Triton kernel or to its torch reference.

`use_triton` answers for a tensor: True for CUDA tensors when triton imports, and for any tensor when
``POLICYZOO_TRITON=1`` (CPU tensors then run in Triton's interpreter). `routed` turns an op's Triton
path into its public function: the kernel where `use_triton` says so for the call's first argument
and the op takes the call's shapes (``takes``), else the reference. No call site decides.

Interpret mode: `triton.jit` reads ``TRITON_INTERPRET`` as each kernel is defined, triton's own
standard library included, so the variable must be set before triton is first imported (importing
transformers or torch._dynamo imports it). To run the kernels on CPU tensors, start the process with
``TRITON_INTERPRET=1`` and ``POLICYZOO_TRITON=1``.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import TypeVar

from torch import Tensor

try:
    import triton

    HAS_TRITON = True
    # True when the kernels run in triton's interpreter (CPU tensors); read once, as triton does. Its
    # tl.dot multiplies bfloat16 operands as their raw bits, so under it the kernels widen them to fp32
    # first (bf16 products are exact in fp32: the arithmetic of a bf16 tensor-core dot); its fp32 ->
    # bf16 casts truncate, so a bf16 output can differ from the GPU's by one ulp.
    INTERPRET = bool(triton.knobs.runtime.interpret)
except Exception:  # no triton, or one that cannot load here: the references serve every call
    HAS_TRITON = False
    INTERPRET = False

F = TypeVar("F", bound=Callable)


def use_triton(t: Tensor) -> bool:
    """Whether calls on tensor ``t`` go to the Triton kernels: CUDA tensors when triton imported, any
    tensor when ``POLICYZOO_TRITON=1`` (CPU tensors need ``TRITON_INTERPRET=1`` too, see above)."""
    if not HAS_TRITON:
        return False
    return t.is_cuda or os.environ.get("POLICYZOO_TRITON") == "1"


def need_triton() -> None:
    """Raise unless the kernels can run: triton imported."""
    if not HAS_TRITON:
        raise RuntimeError("policyzoo Triton kernels need triton (pip install 'policyzoo[triton]')")


def check_device(t: Tensor) -> None:
    """Raise for a CPU tensor outside the interpreter: compiled Triton kernels take device tensors."""
    if t.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first imported")


def routed(reference: Callable, takes: Callable[..., bool] | None = None) -> Callable[[F], F]:
    """Make an op's Triton path (the decorated function) its public function.

    The function returned calls the Triton path when `use_triton` holds for the call's first argument
    and ``takes(*args, **kwargs)`` (if given: the shapes the kernel can take) agrees, else
    ``reference`` with the same arguments, less the keyword-only arguments it does not name (those
    of the launch alone, such as ``workspace``). Both stay reachable as its ``triton`` and
    ``reference`` attributes."""

    def wrap(triton_path: F) -> F:
        first = next(iter(inspect.signature(triton_path).parameters))
        known = set(inspect.signature(reference).parameters)

        @functools.wraps(triton_path)
        def op(*args, **kwargs):
            t = args[0] if args else kwargs[first]
            if use_triton(t) and (takes is None or takes(*args, **kwargs)):
                return triton_path(*args, **kwargs)
            return reference(*args, **{k: v for k, v in kwargs.items() if k in known})

        op.triton = triton_path
        op.reference = reference
        return op  # type: ignore[return-value]

    return wrap


__all__ = ["HAS_TRITON", "INTERPRET", "use_triton", "need_triton", "check_device", "routed"]
