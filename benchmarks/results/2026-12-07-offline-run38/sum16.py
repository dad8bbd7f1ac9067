"""Run 38: a variant of the half2 kernel (a source rewrite of `half2.py`, built into /tmp): the two
chains of a column added in fp16, and the pair's halves too, before one conversion. Two fp16
roundings more in the bound (slack 11.1u instead of 9.1u, not accounted here: the experiment's
check, twice the slack, covers it on these keys). `sum16_bound` launches it as the op would."""
import importlib.util
import pathlib
import sys

import torch

from policyzoo.kernels.ops.sketch_page_bound import half2

SRC = (pathlib.Path(half2.__file__).read_text().replace("from ... import route", "from policyzoo.kernels import route")
       .replace("from . import reference", "from policyzoo.kernels.ops.sketch_page_bound import reference")
       .replace("from .shared import", "from policyzoo.kernels.ops.sketch_page_bound.shared import"))
CALL = "        coded = _chain(ca + cb, pa + pb, EMULATE) + _chain(cc + cd, pc + pd, EMULATE)\n"
assert CALL in SRC
SUM16 = '''

@triton.jit
def _chain16(c, w, EMULATE: tl.constexpr):
    if EMULATE:
        return _chain(c[:8], w[:8], EMULATE) + _chain(c[8:], w[8:], EMULATE)
    else:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 h, g;
            .reg .f16 l, u, s;
            mul.rn.f16x2 h, $1, $17;
            fma.rn.f16x2 h, $2, $18, h;
            fma.rn.f16x2 h, $3, $19, h;
            fma.rn.f16x2 h, $4, $20, h;
            fma.rn.f16x2 h, $5, $21, h;
            fma.rn.f16x2 h, $6, $22, h;
            fma.rn.f16x2 h, $7, $23, h;
            fma.rn.f16x2 h, $8, $24, h;
            mul.rn.f16x2 g, $9, $25;
            fma.rn.f16x2 g, $10, $26, g;
            fma.rn.f16x2 g, $11, $27, g;
            fma.rn.f16x2 g, $12, $28, g;
            fma.rn.f16x2 g, $13, $29, g;
            fma.rn.f16x2 g, $14, $30, g;
            fma.rn.f16x2 g, $15, $31, g;
            fma.rn.f16x2 g, $16, $32, g;
            add.rn.f16x2 h, h, g;
            mov.b32 {l, u}, h;
            add.rn.f16 s, l, u;
            cvt.f32.f16 $0, s;
            }""",
            constraints="=f" + ",r" * 32, args=list(c) + list(w), dtype=tl.float32, is_pure=True, pack=1)
'''
path = pathlib.Path("/tmp/half2_sum16.py")
path.write_text(SRC.replace(CALL, "        coded = _chain16(ca + cb + cc + cd, pa + pb + pc + pd, EMULATE)\n") + SUM16)
spec = importlib.util.spec_from_file_location("half2_sum16", path)
sum16 = importlib.util.module_from_spec(spec)
sys.modules["half2_sum16"] = sum16
spec.loader.exec_module(sum16)


def sum16_bound(q, codes, mn, mx, start, length, scale, agg, pages, cfg):
    b, h, _ = q.shape
    n_pages = mn.shape[2]
    n_entries = n_pages if pages is None else pages.shape[-1]
    out = torch.empty(b, h if agg == "none" else mn.shape[1], n_entries, dtype=torch.float32, device=q.device)
    sum16.launch(q, codes, mn, mx, start, length, pages if pages is not None else out, out, n_pages, n_entries, scale,
                 agg, pages, cfg)
    return out


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run in Triton's interpreter


