"""How this process runs the Triton kernels under test, decided before triton is first imported.

Triton decides between compiled and interpreted kernels when each ``@triton.jit`` function is
defined, library included, so ``TRITON_INTERPRET=1`` must be in the environment before triton is
first imported. Import this module first thing in a kernel test module (``from triton_mode import
MODE``): it sets the variable when it can (on CPU, triton not yet loaded).

`MODE`: ``"cuda"`` (the compiled kernels), ``"interpret"`` (CPU tensors through the interpreter), or
``"subprocess"`` (triton already loaded in compiled mode: interpreted kernels cannot run in this
process, so the module re-runs itself in a fresh interpreter with the variable set).
"""

import os
import sys

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
