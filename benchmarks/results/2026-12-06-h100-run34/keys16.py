"""Experiment: the key-sketch page bound on the tensor cores, the keys decoded two nibbles at a time.

The codes are read as 32-bit words, a program's tokens as rows ``[BLOCK_P·PAGE, words]``. Each
word's nibbles become exact fp16 values by bit operations: ``(word >> 4s) & 0x000F000F | 0x64006400``
holds two fp16 numbers ``1024 + c``, and subtracting 1024 gives ``c``. The keys are then
``k16 = c·step16 + min16`` in fp16, and one tl.dot per nibble position takes ``[tokens, words] ×
[words, heads]`` against the group's queries in fp16. The bound adds, per channel,
``|q|·(radius + e) + |q - q16|·(max|k| + e)``, where ``e = max|k|·(2^-8 + 2^-17) + 2^-20`` covers
every fp16 rounding of ``step``, ``min`` and the key (two roundings, fused or not). Channels whose
keys do not fit in 30000 decode as 0 with ``e = max|k|``. See the README for the derivation.

Usage (from the repository root): ``python benchmarks/results/2026-12-06-h100-run34/keys16.py``
times it at 128K against the default method on a CUDA machine, or checks it at 1K with
``TRITON_INTERPRET=1 N=1024`` on the CPU.
"""

import dataclasses
import os

import torch
import triton
import triton.language as tl

from policyzoo.kernels.ops.sketch_page_bound.kernel import _entries, _fp16, _store_best


@triton.jit
def _sketch_keys16_kernel(
    q_ptr, word_ptr, mn_ptr, mx_ptr, start_ptr, length_ptr, list_ptr, out_ptr,
    s_qb, s_qh, s_wb, s_wh, s_wt, s_mb, s_mh, s_mp, s_xb, s_xh, s_xp, s_lb, s_lh, s_ob, s_oh,
    n_pages, n_entries, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DH: tl.constexpr, WORDS: tl.constexpr,
    W_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr, AGG: tl.constexpr, LISTED: tl.constexpr,
):
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_e, e_mask, offs_p, p_mask = _entries(list_ptr, b, kv, s_lb, s_lh, n_pages, n_entries, BLOCK_P, LISTED)
    start = tl.load(start_ptr + b)
    length = tl.load(length_ptr)
    offs_t = tl.arange(0, PAGE)
    offs_u = tl.arange(0, W_PAD)
    offs_g = tl.arange(0, G_PAD)
    u_ok = offs_u < WORDS
    g_ok = offs_g[None, :] < G
    slot = offs_p[:, None] * PAGE + offs_t[None, :]  # [BLOCK_P, PAGE]
    seen = p_mask[:, None] & (slot >= start) & (slot < length)
    words = tl.load(word_ptr + b * s_wb + kv * s_wh + slot[:, :, None].to(tl.int64) * s_wt + offs_u[None, None, :],
                    mask=seen[:, :, None] & u_ok[None, None, :], other=0)  # [BLOCK_P, PAGE, W_PAD]
    mn_row = mn_ptr + b * s_mb + kv * s_mh + offs_p[:, None] * s_mp
    mx_row = mx_ptr + b * s_xb + kv * s_xh + offs_p[:, None] * s_xp
    q_col = q_ptr + b * s_qb + (kv * G + offs_g[None, :]) * s_qh
    acc = tl.zeros([BLOCK_P * PAGE, G_PAD], tl.float32)
    base = tl.zeros([BLOCK_P, G_PAD], tl.float32)
    for S in tl.static_range(4):
        pair = ((words >> (4 * S)) & 0x000F000F) | 0x64006400
        for HALF in tl.static_range(2):
            if HALF == 0:
                bits = pair & 0xFFFF
            else:
                bits = pair >> 16
            c16 = bits.to(tl.int16).to(tl.float16, bitcast=True) - 1024.0  # the codes, exact
            # Nibble S of bytes 0-1 (HALF 0) or 2-3 (HALF 1): byte S // 2 + 2·HALF, low nibble for even S.
            ch = 4 * offs_u + (S // 2 + 2 * HALF) + (S % 2) * DH  # [W_PAD]
            ok = u_ok & (ch < D)
            pm = p_mask[:, None] & ok[None, :]
            mn = tl.load(mn_row + ch[None, :], mask=pm, other=0.0).to(tl.float32)  # [BLOCK_P, W_PAD]
            mx = tl.load(mx_row + ch[None, :], mask=pm, other=0.0).to(tl.float32)
            step = (mx - mn) / 15.0
            big = tl.maximum(tl.abs(mn), tl.abs(mx))
            rad = step * (0.5 + 1.0 / 4096) + (1.0 / 1048576) * big
            fits = tl.abs(mn) + 15.0 * tl.abs(step) <= 30000.0
            mn16 = tl.where(fits, mn, 0.0).to(tl.float16)
            step16 = tl.where(fits, step, 0.0).to(tl.float16)
            err = tl.where(fits, big * (1.0 / 256 + 1.0 / 131072) + 1.0 / 1048576, big)
            k16 = c16 * step16[:, None, :] + mn16[:, None, :]  # [BLOCK_P, PAGE, W_PAD], fp16
            qv = tl.load(q_col + ch[:, None], mask=ok[:, None] & g_ok, other=0.0).to(tl.float32)  # [W_PAD, G_PAD]
            q16 = _fp16(qv)
            acc = tl.dot(tl.reshape(k16, (BLOCK_P * PAGE, W_PAD)), q16, acc)
            for g in tl.static_range(G):  # the slack per head: |q|·(radius + e) + |q - q16|·(max|k| + e)
                qg = tl.load(q_ptr + b * s_qb + (kv * G + g) * s_qh + ch, mask=ok, other=0.0).to(tl.float32)  # [W_PAD]
                dqg = tl.abs(qg - _fp16(qg).to(tl.float32))
                own = tl.sum((rad + err) * tl.abs(qg)[None, :] + (big + err) * dqg[None, :], 1)  # [BLOCK_P]
                base += tl.where(offs_g[None, :] == g, own[:, None], 0.0)
    acc3 = tl.reshape(acc, (BLOCK_P, PAGE, G_PAD))
    bound = tl.where(seen[:, :, None], (acc3 + base[:, None, :]) * scale, -float("inf"))
    best = tl.max(bound, 1)  # [BLOCK_P, G_PAD]
    _store_best(out_ptr, best, b, kv, s_ob, s_oh, offs_e, e_mask, G, G_PAD, AGG)


def sketch_keys16(q, codes, page_min, page_max, start, length, scale, agg="max", pages=None, block_p=8, num_warps=4):
    b, h, d = q.shape
    _, h_kv, n_pages, _ = page_min.shape
    page = codes.shape[2] // n_pages
    n_entries = n_pages if pages is None else pages.shape[-1]
    out = torch.empty(b, h if agg == "none" else h_kv, n_entries, dtype=torch.float32, device=q.device)
    listed = pages if pages is not None else out
    words = codes.view(torch.int32)
    n_words = codes.shape[-1] // 4
    _sketch_keys16_kernel[(triton.cdiv(n_entries, block_p), h_kv, b)](
        q, words, page_min, page_max, start, length, listed, out,
        q.stride(0), q.stride(1), words.stride(0), words.stride(1), words.stride(2),
        page_min.stride(0), page_min.stride(1), page_min.stride(2),
        page_max.stride(0), page_max.stride(1), page_max.stride(2),
        listed.stride(0), listed.stride(1), out.stride(0), out.stride(1),
        n_pages, n_entries, float(scale),
        G=h // h_kv, G_PAD=max(16, triton.next_power_of_2(h // h_kv)), D=d, DH=codes.shape[-1],
        WORDS=n_words, W_PAD=max(16, triton.next_power_of_2(n_words)), PAGE=page, BLOCK_P=block_p,
        AGG=0 if agg == "none" else 1, LISTED=pages is not None, num_warps=num_warps,
    )
    return out


def main() -> None:
    from benchmarks.probes import D, H, filled_cache
    from policyzoo.kernels import reference
    from policyzoo.kernels.ops.sketch_page_bound import SketchScoreConfig
    from policyzoo.kernels.ops.sketch_page_bound import kernel as K

    n = int(os.environ.get("N", 131072))
    cache = filled_cache(n)
    dev = cache.page_min[0].device
    q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
    args = (q, cache.key_sketch[0], cache.page_min[0], cache.page_max[0], cache.start, cache.length, D**-0.5)
    ref = reference.sketch_page_bound(*args, "max")
    fin = torch.isfinite(ref)
    base = SketchScoreConfig()
    cases = [("rows 8/1/4 (default)", lambda: K.sketch_page_bound(*args, "max", None, base))]
    tiles = ((1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (8, 4), (4, 2), (8, 8), (16, 8)) if dev.type == "cuda" else ((2, 4),)
    for bp, w in tiles:
        cases.append((f"keys16 {bp}/{w}", lambda bp=bp, w=w: sketch_keys16(*args, "max", None, bp, w)))
    for label, fn in cases:
        try:
            out = fn()
        except Exception as e:
            print(f"{label:<22} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        above = ((out - ref)[fin]).min().item()  # >= 0 up to fp32 sums: an upper bound
        slack = ((out - ref)[fin]).mean().item()
        ok = bool((torch.isfinite(out) == fin).all()) and above >= -1e-3
        us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3 if out.is_cuda else float("nan")
        print(f"{label:<22} {us:8.1f} us  out - ref: min {above:+.2e}, mean {slack:+.2e} {'ok' if ok else 'WRONG'}", flush=True)


if __name__ == "__main__":
    main()
