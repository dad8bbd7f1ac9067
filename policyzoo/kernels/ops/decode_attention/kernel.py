"""Split-K decode attention over a `Selection`, softmax or 1.5-entmax (Triton).

One query token per batch row attends to the cache entries a KV policy selected; the specification is
`reference.decode_attention` (softmax) and `reference.decode_attention_entmax15`, beside this file.

Softmax, two launches:

1. `_softmax_chunk_kernel`, grid ``(chunks, H_kv, B)``. A program takes ``chunk`` consecutive entries
   of the selection of one (row, KV head) — tokens when ``block == 1``, pages of ``block`` tokens
   otherwise — and all G query heads of the GQA group, so each selected key and value is read once
   per group. It walks the chunk's tokens in tiles of ``block_t`` (online softmax) and writes the
   chunk's partial max ``m``, sum ``l`` and unnormalised output ``o``.
2. `_merge_kernel`, grid ``(H, B)``, merges the chunks of each (row, query head) by log-sum-exp into
   ``out`` and ``lse``, ``block_c`` partials per step. (Merging in the last chunk program of each
   KV head instead, after an arrival counter, measured slower than this second launch.)

1.5-entmax, two passes over the selection (keys in the first, values in the second):

1. `_entmax_logits_kernel`, grid ``(chunks, H_kv, B)``: ``x = (scale·q·k + log_weight) / 2`` of every
   selected token into an fp32 scratch ``[B, H, K_max·block]`` (``-inf`` where not visible).
2. `_entmax_tau_kernel`, grid ``(H, B)``: the threshold ``tau`` with ``Σ max(0, x − tau)² = 1``.
   Bisection on ``tau`` over the scratch (bracket ``[max − 1, max − 1/√n]``, ``n_bisect`` steps)
   finds the support; the exact ``tau`` for that support then follows in closed form (the root of
   ``Σ_S (x − tau)² = 1``, as in the sort-based algorithm). Bisection rather than a sort because a
   sort of a long selection does not fit one program; the closed form removes the bisection error,
   which only remains for entries within 2^-n_bisect of ``tau`` (weight < 2^-2·n_bisect either way).
3. `_entmax_out_kernel`, grid ``(chunks, H_kv, B)``: ``Σ p·v`` per chunk with ``p = max(0, x − tau)²``;
   values are loaded only for tokens in the support of some head of the group.
4. The chunk outputs are summed (no normalisation: the weights already sum to one).

Index arithmetic: token ``f`` of a selection (``0 <= f < count·block``) is offset ``f % block`` of entry
``f // block``, i.e. cache slot ``indices[f // block]·block + f % block``; the tokens of one page are
contiguous in memory. Tokens at or past ``count·block``, or outside ``start[b] <= pos < length``, are
masked and never loaded. ``length`` is read from device memory (no host sync, CUDA-graph safe).
With ``slots`` (an offloaded layer's page cache, `offload.PageCache`), ``keys`` and ``values`` are the
cache's slots and a token is loaded from row ``slots[f // block]·block + f % block``; its position,
and so its masking, is still the one ``indices`` gives.

Launch parameters: the `AttentionConfig` the op chose for the call (`attention_config`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import route


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and scratch buffer comes from here (uninitialised; the tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _chunk_span(start_ptr, len_ptr, cnt_ptr, s_cb, s_ch, b, kv, c, k_max, chunk, BLOCK: tl.constexpr):
    """``(start, length, f_begin, f_end)`` of chunk ``c`` of row ``b``'s selection for KV head ``kv``:
    the row's visible span, and the chunk's tokens ``f_begin <= f < f_end``, i.e. its entries
    ``[c·chunk, min((c+1)·chunk, count))`` expanded to ``BLOCK`` tokens each."""
    start = tl.load(start_ptr + b)
    length = tl.load(len_ptr)
    count = tl.minimum(tl.load(cnt_ptr + b * s_cb + kv * s_ch), k_max)
    return start, length, c * chunk * BLOCK, tl.minimum((c + 1) * chunk, count) * BLOCK


@triton.jit
def _tile_tokens(idx_row, s_ik, slot_row, s_sk, f, f_end, start, length, n, BLOCK: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """Entry, cache position, row to read and visibility of the selection tokens ``f`` (a tile).

    The row is the position, or with ``slots`` the same offset in the entry's slot of a page cache
    (`offload.PageCache`): visibility always follows the token's position in the sequence."""
    in_chunk = f < f_end
    entry = f // BLOCK
    page = tl.load(idx_row + entry * s_ik, mask=in_chunk, other=0).to(tl.int64)
    pos = page * BLOCK + f % BLOCK
    visible = in_chunk & (pos >= start) & (pos < length) & (pos < n)
    if HAS_SLOTS:
        slot = tl.load(slot_row + entry * s_sk, mask=in_chunk, other=0).to(tl.int64)
        row = slot * BLOCK + f % BLOCK
    else:
        row = pos
    return entry, row, in_chunk, visible


@triton.jit
def _tile_logits(
    q, k_row, lw_row, s_kn, s_lw, entry, row, in_chunk, visible, offs_d, scale,
    HAS_LW: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """``[G_PAD, BLOCK_T]`` logits ``scale·q·k (+ log_weight)``, ``-inf`` where not visible."""
    k = tl.load(
        k_row + row[:, None] * s_kn + offs_d[None, :],
        mask=visible[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    s = _dot(q, tl.trans(k), UPCAST, PRECISION) * scale
    if HAS_LW:
        s += tl.load(lw_row + entry * s_lw, mask=in_chunk, other=0.0).to(tl.float32)[None, :]
    return tl.where(visible[None, :], s, -float("inf"))


@triton.jit
def _load_group_q(q_ptr, b, kv, s_qb, s_qh, offs_g, offs_d, G: tl.constexpr, D: tl.constexpr):
    """The G query heads of KV head ``kv`` as ``[G_PAD, D_PAD]`` (padding rows and columns are 0)."""
    ptrs = q_ptr + b * s_qb + (kv * G + offs_g)[:, None] * s_qh + offs_d[None, :]
    return tl.load(ptrs, mask=(offs_g[:, None] < G) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _softmax_chunk_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, slot_ptr, cnt_ptr, lw_ptr, start_ptr, len_ptr,
    m_ptr, l_ptr, o_ptr,
    s_qb, s_qh,
    s_kb, s_kh, s_kn,
    s_vb, s_vh, s_vn,
    s_ib, s_ih, s_ik,
    s_sb, s_sh, s_sk,
    s_cb, s_ch,
    s_lb, s_lh, s_lk,
    n, k_max, chunk, n_chunks, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_LW: tl.constexpr, HAS_SLOTS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, BLOCK_T)

    start, length, f_begin, f_end = _chunk_span(start_ptr, len_ptr, cnt_ptr, s_cb, s_ch, b, kv, c, k_max, chunk, BLOCK)

    q = _load_group_q(q_ptr, b, kv, s_qb, s_qh, offs_g, offs_d, G, D)
    idx_row = idx_ptr + b * s_ib + kv * s_ih
    slot_row = slot_ptr + b * s_sb + kv * s_sh
    lw_row = lw_ptr + b * s_lb + kv * s_lh
    k_row = k_ptr + b * s_kb + kv * s_kh
    v_row = v_ptr + b * s_vb + kv * s_vh

    m_i = tl.full([G_PAD], -float("inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    # Chunks past `count` skip the loop and still write (m=-inf, l=0, o=0): the merge reads every chunk.
    for f0 in range(f_begin, f_end, BLOCK_T):
        entry, row, in_chunk, visible = _tile_tokens(idx_row, s_ik, slot_row, s_sk, f0 + offs_t, f_end, start, length, n, BLOCK, HAS_SLOTS)
        s = _tile_logits(q, k_row, lw_row, s_kn, s_lk, entry, row, in_chunk, visible, offs_d, scale,
                         HAS_LW, D, UPCAST, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # While a head has seen nothing visible its max is -inf; exponentiate against 0 instead so
        # that exp(-inf - -inf) = NaN never appears (every term is then exp(-inf) = 0).
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_row + row[:, None] * s_vn + offs_d[None, :],
            mask=visible[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PRECISION)
        m_i = m_new

    # Partials are [B, H, n_chunks(, D)], contiguous.
    head = b * (G * tl.num_programs(1)) + kv * G + offs_g
    g_mask = offs_g < G
    tl.store(m_ptr + head * n_chunks + c, m_i, mask=g_mask)
    tl.store(l_ptr + head * n_chunks + c, l_i, mask=g_mask)
    tl.store(
        o_ptr + (head * n_chunks + c)[:, None] * D + offs_d[None, :],
        acc,
        mask=g_mask[:, None] & (offs_d[None, :] < D),
    )


@triton.jit
def _merge_kernel(
    m_ptr, l_ptr, o_ptr, out_ptr, lse_ptr,
    s_ob, s_oh, n_chunks,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Log-sum-exp merge of the chunk partials of one (query head, row) into ``out`` and ``lse``,
    ``BLOCK_C`` chunks per step."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    head = b * tl.num_programs(0) + h
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, D_PAD)

    m_run = -float("inf")
    l_run = 0.0
    acc = tl.zeros([D_PAD], tl.float32)
    for c0 in range(0, n_chunks, BLOCK_C):
        cs = c0 + offs_c
        mask = cs < n_chunks
        part = head * n_chunks + cs
        m = tl.load(m_ptr + part, mask=mask, other=-float("inf"))
        l = tl.load(l_ptr + part, mask=mask, other=0.0)
        o = tl.load(o_ptr + part[:, None] * D + offs_d[None, :], mask=mask[:, None] & (offs_d[None, :] < D), other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # same -inf guard as the chunk kernel
        alpha = tl.exp(m_run - m_safe)
        w = tl.exp(m - m_safe)
        l_run = l_run * alpha + tl.sum(w * l, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m_run = m_new

    empty = l_run == 0.0  # no visible entry: out = 0, lse = -inf
    out = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, l_run))
    lse = tl.where(empty, -float("inf"), m_run + tl.log(tl.where(empty, 1.0, l_run)))
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d, out, mask=offs_d < D)
    tl.store(lse_ptr + head, lse)


@triton.jit
def _entmax_logits_kernel(
    q_ptr, k_ptr, idx_ptr, slot_ptr, cnt_ptr, lw_ptr, start_ptr, len_ptr, x_ptr,
    s_qb, s_qh,
    s_kb, s_kh, s_kn,
    s_ib, s_ih, s_ik,
    s_sb, s_sh, s_sk,
    s_cb, s_ch,
    s_lb, s_lh, s_lk,
    n, k_max, chunk, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_LW: tl.constexpr, HAS_SLOTS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, BLOCK_T)

    start, length, f_begin, f_end = _chunk_span(start_ptr, len_ptr, cnt_ptr, s_cb, s_ch, b, kv, c, k_max, chunk, BLOCK)

    q = _load_group_q(q_ptr, b, kv, s_qb, s_qh, offs_g, offs_d, G, D)
    idx_row = idx_ptr + b * s_ib + kv * s_ih
    slot_row = slot_ptr + b * s_sb + kv * s_sh
    lw_row = lw_ptr + b * s_lb + kv * s_lh
    k_row = k_ptr + b * s_kb + kv * s_kh
    m_tok = k_max * BLOCK
    head = b * (G * tl.num_programs(1)) + kv * G + offs_g
    for f0 in range(f_begin, f_end, BLOCK_T):
        f = f0 + offs_t
        entry, row, in_chunk, visible = _tile_tokens(idx_row, s_ik, slot_row, s_sk, f, f_end, start, length, n, BLOCK, HAS_SLOTS)
        s = _tile_logits(q, k_row, lw_row, s_kn, s_lk, entry, row, in_chunk, visible, offs_d, scale,
                         HAS_LW, D, UPCAST, PRECISION)
        # Scratch entries past count·block are never written; the later kernels never read them.
        tl.store(x_ptr + head[:, None] * m_tok + f[None, :], s * 0.5,
                 mask=(offs_g[:, None] < G) & in_chunk[None, :])


@triton.jit
def _entmax_tau_kernel(
    x_ptr, cnt_ptr, tau_ptr,
    s_cb, s_ch, k_max,
    G: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, N_BISECT: tl.constexpr,
):
    """Threshold of one (row, query head) over its scratch row of halved logits."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    head = b * tl.num_programs(0) + h
    count = tl.minimum(tl.load(cnt_ptr + b * s_cb + (h // G) * s_ch), k_max)
    n_tok = count * BLOCK
    row = x_ptr + head * (k_max * BLOCK)
    offs = tl.arange(0, BLOCK_M)

    # Max and number of visible tokens.
    top = -float("inf")
    n_vis = 0.0
    for m0 in range(0, n_tok, BLOCK_M):
        x = tl.load(row + m0 + offs, mask=m0 + offs < n_tok, other=-float("inf"))
        top = tl.maximum(top, tl.max(x, 0))
        n_vis += tl.sum((x > -float("inf")).to(tl.float32), 0)

    if n_vis == 0.0:
        tl.store(tau_ptr + head, -float("inf"))
    else:
        # Work with y = x - top <= 0. The threshold t (in y units) lies in [-1, -1/sqrt(n)]: at -1
        # the top entry alone has weight 1; at -1/sqrt(n) no entry has more than 1/n.
        lo = -1.0
        hi = -1.0 / tl.sqrt(n_vis)
        for _ in range(N_BISECT):
            mid = 0.5 * (lo + hi)
            mass = 0.0
            for m0 in range(0, n_tok, BLOCK_M):
                y = tl.load(row + m0 + offs, mask=m0 + offs < n_tok, other=-float("inf")) - top
                r = tl.maximum(y - mid, 0.0)
                mass += tl.sum(r * r, 0)
            lo = tl.where(mass >= 1.0, mid, lo)
            hi = tl.where(mass >= 1.0, hi, mid)
        # Exact threshold for the support S = {y > lo}: the root of Σ_S (y − t)² = 1 below the
        # support, t = mean − sqrt((1 − Σ_S (y − mean)²) / |S|).
        k = 0.0
        s1 = 0.0
        s2 = 0.0
        for m0 in range(0, n_tok, BLOCK_M):
            y = tl.load(row + m0 + offs, mask=m0 + offs < n_tok, other=-float("inf")) - top
            in_s = y > lo
            k += tl.sum(in_s.to(tl.float32), 0)
            s1 += tl.sum(tl.where(in_s, y, 0.0), 0)
            s2 += tl.sum(tl.where(in_s, y * y, 0.0), 0)
        mean = s1 / k
        delta = tl.maximum((1.0 - (s2 - s1 * mean)) / k, 0.0)
        t = tl.minimum(tl.maximum(mean - tl.sqrt(delta), lo), hi)
        tl.store(tau_ptr + head, t + top)


@triton.jit
def _entmax_out_kernel(
    v_ptr, idx_ptr, slot_ptr, cnt_ptr, start_ptr, len_ptr, x_ptr, tau_ptr, o_ptr,
    s_vb, s_vh, s_vn,
    s_ib, s_ih, s_ik,
    s_sb, s_sh, s_sk,
    s_cb, s_ch,
    n, k_max, chunk, n_chunks,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_SLOTS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    c = tl.program_id(0)
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, BLOCK_T)
    g_mask = offs_g < G

    start, length, f_begin, f_end = _chunk_span(start_ptr, len_ptr, cnt_ptr, s_cb, s_ch, b, kv, c, k_max, chunk, BLOCK)

    head = b * (G * tl.num_programs(1)) + kv * G + offs_g
    # A head without visible tokens has tau = -inf and only x = -inf: use tau = 0 there (and for the
    # padding heads, whose x is -inf too) so that x - tau is -inf (weight 0) rather than NaN.
    tau = tl.load(tau_ptr + head, mask=g_mask, other=0.0)
    tau = tl.where(tau == -float("inf"), 0.0, tau)
    idx_row = idx_ptr + b * s_ib + kv * s_ih
    slot_row = slot_ptr + b * s_sb + kv * s_sh
    v_row = v_ptr + b * s_vb + kv * s_vh
    m_tok = k_max * BLOCK

    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for f0 in range(f_begin, f_end, BLOCK_T):
        f = f0 + offs_t
        entry, row, in_chunk, visible = _tile_tokens(idx_row, s_ik, slot_row, s_sk, f, f_end, start, length, n, BLOCK, HAS_SLOTS)
        x = tl.load(x_ptr + head[:, None] * m_tok + f[None, :],
                    mask=g_mask[:, None] & in_chunk[None, :], other=-float("inf"))
        d = x - tau[:, None]
        p = tl.where(d > 0.0, d * d, 0.0)
        # Entmax is sparse: read a value row only if some head of the group gives it weight.
        needed = visible & (tl.max(p, 0) > 0.0)
        v = tl.load(
            v_row + row[:, None] * s_vn + offs_d[None, :],
            mask=needed[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        acc += _dot(p.to(v.dtype), v, UPCAST, PRECISION)

    tl.store(
        o_ptr + (head * n_chunks + c)[:, None] * D + offs_d[None, :],
        acc,
        mask=g_mask[:, None] & (offs_d[None, :] < D),
    )


def decode_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    indices: Tensor,
    count: Tensor,
    log_weight: Tensor | None,
    block: int,
    start: Tensor,
    length: Tensor,
    scale: float,
    mode: str,
    slots: Tensor | None,
    cfg,
) -> tuple[Tensor, Tensor]:
    """Launch the kernels with ``cfg`` (an `AttentionConfig` with its chunk and merge step chosen);
    arguments as `reference.decode_attention` with the Selection unpacked.

    ``mode`` is ``"softmax"`` (returns ``(out, lse)``) or ``"entmax15"`` (returns ``(out, tau)``).
    ``slots``: as in `reference.decode_attention`.
    """
    if mode not in ("softmax", "entmax15"):
        raise ValueError(f"mode must be 'softmax' or 'entmax15', got {mode!r}")
    route.check_device(q)
    b, h, d = q.shape
    _, h_kv, n, _ = keys.shape
    if slots is not None:
        if slots.shape != indices.shape:
            raise ValueError(f"slots must be shaped as the selection's indices {tuple(indices.shape)}, got {tuple(slots.shape)}")
        n = 2**31 - 1  # keys are slots of a page cache, not positions: only start and length bound a position
    g = h // h_kv
    # The kernels index the head dim with unit stride.
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    has_lw, has_slots = log_weight is not None, slots is not None
    selection = dict(
        indices=indices, count=count, start=start, length=length.reshape(()),
        lw=log_weight if has_lw else indices,  # a dummy pointer, never read when HAS_LW is False
        slot=slots if has_slots else indices,  # the same: never read without HAS_SLOTS
        n=n, k_max=indices.shape[-1], chunk=cfg.chunk, n_chunks=max(1, triton.cdiv(indices.shape[-1], cfg.chunk)),
    )
    common = dict(
        G=g, G_PAD=max(16, triton.next_power_of_2(g)),  # tl.dot wants M >= 16
        D=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK=block, BLOCK_T=cfg.block_t, HAS_SLOTS=has_slots,
        UPCAST=route.INTERPRET and keys.dtype == torch.bfloat16,  # the interpreter's tl.dot takes bf16 as raw bits
        PRECISION="ieee" if keys.dtype == torch.float32 or route.INTERPRET else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    out = _alloc(b, h, d, dtype=q.dtype, device=q.device)
    second = _alloc(b, h, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, second
    launch = _softmax if mode == "softmax" else _entmax15
    launch(q, keys, values, float(scale), has_lw, selection, common, cfg, out, second)
    return out, second


def _strides(t: Tensor, dims: int) -> tuple[int, ...]:
    return tuple(t.stride(i) for i in range(dims))


def _softmax(q, keys, values, scale, has_lw, s, common, cfg, out, lse) -> None:
    """Chunk partials, then their log-sum-exp merge into ``out`` and ``lse``."""
    b, h, d = q.shape
    o_part = _alloc(b, h, s["n_chunks"], d, dtype=torch.float32, device=q.device)
    m_part = _alloc(b, h, s["n_chunks"], dtype=torch.float32, device=q.device)
    l_part = _alloc(b, h, s["n_chunks"], dtype=torch.float32, device=q.device)
    _softmax_chunk_kernel[(s["n_chunks"], keys.shape[1], b)](
        q, keys, values, s["indices"], s["slot"], s["count"], s["lw"], s["start"], s["length"],
        m_part, l_part, o_part,
        *_strides(q, 2), *_strides(keys, 3), *_strides(values, 3), *_strides(s["indices"], 3), *_strides(s["slot"], 3),
        *_strides(s["count"], 2), *_strides(s["lw"], 3),
        s["n"], s["k_max"], s["chunk"], s["n_chunks"], scale,
        HAS_LW=has_lw, **common,
    )
    _merge_kernel[(h, b)](
        m_part, l_part, o_part, out, lse,
        out.stride(0), out.stride(1), s["n_chunks"],
        D=d, D_PAD=common["D_PAD"], BLOCK_C=cfg.block_c, num_warps=cfg.merge_warps,
    )


def _entmax15(q, keys, values, scale, has_lw, s, common, cfg, out, tau) -> None:
    """Halved logits into a scratch row, the threshold ``tau``, then ``Σ p·v`` per chunk, summed."""
    b, h, d = q.shape
    grid = (s["n_chunks"], keys.shape[1], b)
    o_part = _alloc(b, h, s["n_chunks"], d, dtype=torch.float32, device=q.device)
    x = _alloc(b, h, s["k_max"] * common["BLOCK"], dtype=torch.float32, device=q.device)
    _entmax_logits_kernel[grid](
        q, keys, s["indices"], s["slot"], s["count"], s["lw"], s["start"], s["length"], x,
        *_strides(q, 2), *_strides(keys, 3), *_strides(s["indices"], 3), *_strides(s["slot"], 3),
        *_strides(s["count"], 2), *_strides(s["lw"], 3),
        s["n"], s["k_max"], s["chunk"], scale,
        HAS_LW=has_lw, **common,
    )
    _entmax_tau_kernel[(h, b)](
        x, s["count"], tau, *_strides(s["count"], 2), s["k_max"],
        G=common["G"], BLOCK=common["BLOCK"], BLOCK_M=cfg.block_m, N_BISECT=cfg.n_bisect, num_warps=cfg.tau_warps,
    )
    _entmax_out_kernel[grid](
        values, s["indices"], s["slot"], s["count"], s["start"], s["length"], x, tau, o_part,
        *_strides(values, 3), *_strides(s["indices"], 3), *_strides(s["slot"], 3), *_strides(s["count"], 2),
        s["n"], s["k_max"], s["chunk"], s["n_chunks"],
        **common,
    )
    out.copy_(o_part.sum(2))
