"""How this process runs the Triton kernels under test, decided before triton is first imported.

Triton decides between compiled and interpreted kernels when each ``@triton.jit`` function is
defined, library included, so ``TRITON_INTERPRET=1`` must be in the environment before triton is
first imported. Import this module first thing in a kernel test module (``from triton_mode import
MODE``): it sets the variable when it can (on CPU, triton not yet loaded).

`MODE`: ``"cuda"`` (the compiled kernels), ``"interpret"`` (CPU tensors through the interpreter), or
``"subprocess"`` (triton already loaded in compiled mode: interpreted kernels cannot run in this
process, so the module re-runs itself in a fresh interpreter with the variable set:
`run_in_fresh_interpreter`).

`examples` is a kernel property test's hypothesis budget: the full count on the GPU, half of it in the
interpreter, where one example takes seconds and the CPU suite has a time budget to keep.

`poisoned` makes the buffers a kernel module allocates (through its ``_alloc``) start as garbage, so
that a test sees every entry the kernel fails to write.

`run_for_sm90` runs a snippet that compiles kernels for an H100/H200 (sm_90) with the toolchain
Triton ships (no GPU needed), in a fresh process where the interpreter is off; the snippet calls
``compile_sm90``, defined for it.
"""

import os
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch

if torch.cuda.is_available():
    MODE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    MODE = "interpret"  # set before the process started
elif "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
    MODE = "interpret"
else:
    MODE = "subprocess"


def run_in_fresh_interpreter(test_file: str) -> None:
    """Run the tests of ``test_file`` in a fresh interpreter with ``TRITON_INTERPRET=1``, and fail
    with their output unless they all pass (`MODE` ``"subprocess"``)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"]
    res = subprocess.run(cmd, env=env, cwd=Path(test_file).parents[1], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-20000:] + res.stderr[-5000:]


_SM90_PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, const, types, warp_size=32, **options):
    # ``fn`` compiled for sm_90: ``const`` its constexprs, ``types`` the Triton types of its other
    # arguments (i32 where not named).
    sig = {n: types.get(n, "constexpr" if n in const else "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, warp_size), options=options)
"""


def run_for_sm90(snippet: str) -> str:
    """Run ``snippet`` (which calls ``compile_sm90(fn, const, types, **options)``) in a fresh process
    without ``TRITON_INTERPRET``, from the repository's root; fail with its errors unless it exits
    cleanly, and return what it printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SM90_PRELUDE + snippet], capture_output=True, text=True, env=env,
                         timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def examples(on_gpu: int) -> int:
    """How many hypothesis examples a kernel property test draws: ``on_gpu`` there, half of it (at
    least 5) in the interpreter. The tests keep no example database, so each CI run draws afresh and
    the runs add up to the full search."""
    return on_gpu if MODE == "cuda" else max(5, on_gpu // 2)


@contextmanager
def poisoned(*modules):
    """Within it, every buffer the kernel ``modules`` allocate through their ``_alloc`` starts as NaN
    (integer buffers as -7)."""

    def alloc(*shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device)

    with ExitStack() as stack:
        for module in modules:
            stack.enter_context(mock.patch.object(module, "_alloc", alloc))
        yield
