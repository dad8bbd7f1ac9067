"""Run 42's variants of `kernels.decode_attention`'s softmax launches (the library's kernel is
`policyzoo/kernels/ops/decode_attention/kernel.py`; these were measured against it and not kept).

- `_softmax_chunk_kernel` with ``LOADS``: when a tile's keys and values are read. ``"after"`` is the
  library's order (the values after the tile's logits and softmax); ``"with"`` reads the values beside
  the keys; ``"ahead"`` issues tile i+1's keys and values and tile i+2's selection entries before
  tile i's sums, and reads the entries up to ``k_max`` so that they need not wait for ``count``.
- `_merge_split_kernel`: the log-sum-exp merge with the head dim split over ``D // BLOCK_D`` programs
  a head (the library's merge is one program a head).
"""
import triton
import triton.language as tl

from policyzoo.kernels.ops.decode_attention.kernel import _dot, _load_group_q


@triton.jit
def _tile_tokens(idx_row, s_ik, slot_row, s_sk, f, f_end, f_read, start, length, n, BLOCK: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """Entry, cache position, row to read and visibility of the selection tokens ``f`` (a tile).

    Tokens at or past ``f_end`` are not in the chunk; ``f_read >= f_end`` bounds the entries whose
    index is read (past ``count`` an index is garbage, read but never dereferenced: a bound that does
    not depend on ``count`` lets the read start before ``count`` arrives).
    The row is the position, or with ``slots`` the same offset in the entry's slot of a page cache
    (`offload.PageCache`): visibility always follows the token's position in the sequence."""
    in_chunk = f < f_end
    entry = f // BLOCK
    page = tl.load(idx_row + entry * s_ik, mask=f < f_read, other=0).to(tl.int64)
    pos = page * BLOCK + f % BLOCK
    visible = in_chunk & (pos >= start) & (pos < length) & (pos < n)
    if HAS_SLOTS:
        slot = tl.load(slot_row + entry * s_sk, mask=f < f_read, other=0).to(tl.int64)
        row = slot * BLOCK + f % BLOCK
    else:
        row = pos
    return entry, row, in_chunk, visible


@triton.jit
def _tile_rows(base, stride, row, visible, offs_d, D: tl.constexpr):
    """``[BLOCK_T, D_PAD]`` cache rows ``row`` of one KV head's keys or values (0 where not visible)."""
    return tl.load(base + row[:, None] * stride + offs_d[None, :], mask=visible[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _tile_logits(
    q, k, lw_row, s_lw, entry, in_chunk, visible, scale,
    HAS_LW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """``[G_PAD, BLOCK_T]`` logits ``scale·q·k (+ log_weight)`` of a tile's keys ``k``, ``-inf`` where
    not visible."""
    s = _dot(q, tl.trans(k), UPCAST, PRECISION) * scale
    if HAS_LW:
        s += tl.load(lw_row + entry * s_lw, mask=in_chunk, other=0.0).to(tl.float32)[None, :]
    return tl.where(visible[None, :], s, -float("inf"))


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
    LOADS: tl.constexpr,
):
    c = tl.program_id(0)
    kv = tl.program_id(1)
    b = tl.program_id(2)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, BLOCK_T)

    start = tl.load(start_ptr + b)
    length = tl.load(len_ptr)
    count = tl.minimum(tl.load(cnt_ptr + b * s_cb + kv * s_ch), k_max)
    # This chunk's tokens: entries [c·chunk, min((c+1)·chunk, count)), expanded to pages.
    f_begin = c * chunk * BLOCK
    f_end = tl.minimum((c + 1) * chunk, count) * BLOCK
    f_read = tl.minimum((c + 1) * chunk, k_max) * BLOCK  # "ahead": the entries' reads need not wait for count

    q = _load_group_q(q_ptr, b, kv, s_qb, s_qh, offs_g, offs_d, G, D)
    idx_row = idx_ptr + b * s_ib + kv * s_ih
    slot_row = slot_ptr + b * s_sb + kv * s_sh
    lw_row = lw_ptr + b * s_lb + kv * s_lh
    k_row = k_ptr + b * s_kb + kv * s_kh
    v_row = v_ptr + b * s_vb + kv * s_vh

    m_i = tl.full([G_PAD], -float("inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if LOADS == "ahead":  # the first tile's reads, and the next tile's selection entries
        entry, row, in_chunk, visible = _tile_tokens(idx_row, s_ik, slot_row, s_sk, f_begin + offs_t, f_end, f_read, start, length, n, BLOCK, HAS_SLOTS)
        k = _tile_rows(k_row, s_kn, row, visible, offs_d, D)
        v = _tile_rows(v_row, s_vn, row, visible, offs_d, D)
        entry_1, row_1, in_chunk_1, visible_1 = _tile_tokens(idx_row, s_ik, slot_row, s_sk, f_begin + BLOCK_T + offs_t, f_end, f_read, start, length, n, BLOCK, HAS_SLOTS)
    # Chunks past `count` skip the loop and still write (m=-inf, l=0, o=0): the merge reads every chunk.
    for f0 in range(f_begin, f_end, BLOCK_T):
        if LOADS == "ahead":
            # A program walks a few tiles, each a round trip to memory when read as it is summed.
            # Here the reads run ahead: tile i+1's keys and values (its rows known since the last
            # step) and tile i+2's selection entries are issued before tile i's sums, and no
            # instruction waits on a read issued in the same step.
            entry_2, row_2, in_chunk_2, visible_2 = _tile_tokens(idx_row, s_ik, slot_row, s_sk, f0 + 2 * BLOCK_T + offs_t, f_end, f_read, start, length, n, BLOCK, HAS_SLOTS)
            k_1 = _tile_rows(k_row, s_kn, row_1, visible_1, offs_d, D)
            v_1 = _tile_rows(v_row, s_vn, row_1, visible_1, offs_d, D)
        else:
            entry, row, in_chunk, visible = _tile_tokens(idx_row, s_ik, slot_row, s_sk, f0 + offs_t, f_end, f_end, start, length, n, BLOCK, HAS_SLOTS)
            k = _tile_rows(k_row, s_kn, row, visible, offs_d, D)
            if LOADS == "with":
                v = _tile_rows(v_row, s_vn, row, visible, offs_d, D)
        s = _tile_logits(q, k, lw_row, s_lk, entry, in_chunk, visible, scale, HAS_LW, UPCAST, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # While a head has seen nothing visible its max is -inf; exponentiate against 0 instead so
        # that exp(-inf - -inf) = NaN never appears (every term is then exp(-inf) = 0).
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if LOADS == "after":
            v = _tile_rows(v_row, s_vn, row, visible, offs_d, D)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PRECISION)
        m_i = m_new
        if LOADS == "ahead":
            entry, in_chunk, visible, k, v = entry_1, in_chunk_1, visible_1, k_1, v_1
            entry_1, row_1, in_chunk_1, visible_1 = entry_2, row_2, in_chunk_2, visible_2

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
def _merge_split_kernel(
    m_ptr, l_ptr, o_ptr, out_ptr, lse_ptr,
    s_ob, s_oh, n_chunks,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The library's `_merge_kernel` over ``BLOCK_D`` of the head dim (grid ``(H, B, D // BLOCK_D)``)."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    head = b * tl.num_programs(0) + h
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = d0 + tl.arange(0, BLOCK_D)
    mask = offs_c < n_chunks
    part = head * n_chunks + offs_c
    m = tl.load(m_ptr + part, mask=mask, other=-float("inf"))
    l = tl.load(l_ptr + part, mask=mask, other=0.0)
    o = tl.load(o_ptr + part[:, None] * D + offs_d[None, :], mask=mask[:, None], other=0.0)
    m_run = tl.max(m, 0)
    m_safe = tl.where(m_run == -float("inf"), 0.0, m_run)
    w = tl.exp(m - m_safe)
    l_run = tl.sum(w * l, 0)
    acc = tl.sum(w[:, None] * o, 0)
    empty = l_run == 0.0
    out = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, l_run))
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d, out)
    if d0 == 0:
        tl.store(lse_ptr + head, tl.where(empty, -float("inf"), m_run + tl.log(tl.where(empty, 1.0, l_run))))
