"""One package per op: its public function and custom op (``__init__.py``: also its launch config and
shape rule), its torch reference (``reference.py``) and its Triton kernel and launcher
(``kernel.py``, imported only where triton is). `policyzoo.kernels` re-exports the public functions."""
