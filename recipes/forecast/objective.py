"""What the heads learn: the teacher (the next layer's attention over candidate blocks), the
student (the policy's block scores from the heads' queries), the loss and recall between them, and
the oracle (the student's scoring fed with the layers' own queries)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policyzoo.kv.forecast import ForecastHeads, block_scores, page_means, rotate

from .geometry import Geometry

NEG = -1e9  # "no candidate" as a finite logit: an all -inf row would give NaN gradients


# --------------------------------------------------------------------------------- teacher
def candidate_blocks(positions: Tensor, n_blocks: int, geo: Geometry, offset: int = 0) -> Tensor:
    """``bool[P, NB]``: the blocks the policy may choose for the query at each position, i.e. the
    visible blocks that are not forced. `Forecast.choose` always keeps the block holding the first
    ``sinks`` tokens and the blocks touching the last ``window`` ones (the query's own block too),
    so they carry no training signal. Slot frame: token ``j`` is slot ``offset + j``, the cache's
    first visible slot is ``offset`` and its length ``offset + t + 1``, as at inference."""
    length = offset + positions[:, None] + 1
    lo = torch.arange(n_blocks) * geo.block
    first = lo.clamp(min=offset)[None, :]
    last = torch.minimum(lo[None, :] + geo.block, length)
    visible = first < last
    forced = (first < offset + geo.sinks) | (last > length - max(geo.window, 1))
    return visible & ~forced


def teacher_block_mass(queries: Tensor, keys: Tensor, positions: Tensor, scale: float, block: int, offset: int = 0) -> Tensor:
    """``[P, H_kv, NB]``: where each GQA group's attention at each position goes, per block.

    ``queries [H, P, D]`` are the layer's queries at ``positions``, ``keys [H_kv, T, D]`` its keys
    (both after RoPE). Window ``j`` is the mean of keys ``j`` and ``j + 1`` (the finer (2, 1)
    compression: twice the policy's resolution, so the target is close to token-level attention);
    a query at ``t`` sees the windows that end at or before ``t``. Each query head's softmax over its
    windows is summed over its group and divided by the group size, and window ``j``'s mass goes to
    the block holding token ``j`` (slot ``offset + j``). Rows sum to 1 over all blocks.
    """
    h, p, d = queries.shape
    h_kv, t, _ = keys.shape
    keys = keys.float()
    windows = (keys[:, :-1] + keys[:, 1:]) / 2  # [H_kv, T-1, D]
    q = queries.float().reshape(h_kv, h // h_kv, p, d)
    logits = torch.einsum("kgpd,kwd->kgpw", q, windows) * scale
    seen = torch.arange(1, t)[None, :] <= positions[:, None]  # window j ends at token j + 1
    probs = logits.masked_fill(~seen, -torch.inf).softmax(-1).mean(1)  # [H_kv, P, T-1]
    n_blocks = -(-(offset + t) // block)
    owner = (offset + torch.arange(t - 1)) // block
    mass = probs.new_zeros(h_kv, p, n_blocks).index_add_(-1, owner, probs)
    return mass.transpose(0, 1)


def teacher_distribution(queries: Tensor, keys: Tensor, positions: Tensor, scale: float, geo: Geometry, offset: int = 0) -> Tensor:
    """``[P, H_kv, NB]``: `teacher_block_mass` restricted to the candidate blocks
    (`candidate_blocks`) and renormalised there (zero elsewhere)."""
    mass = teacher_block_mass(queries, keys, positions, scale, geo.block, offset)
    cand = candidate_blocks(positions, mass.shape[-1], geo, offset)[:, None, :]
    mass = mass * cand
    return mass / mass.sum(-1, keepdim=True).clamp(min=1e-30)


# --------------------------------------------------------------------------------- student
def slot_page_means(keys: Tensor, offset: int, stride: int) -> tuple[Tensor, Tensor]:
    """``(means [L, H_kv, pages, D], counts int64[pages])`` of a chunk's keys ``[L, H_kv, T, D]``
    laid out from slot ``offset``: `page_means` over the visible slots, as `Forecast.prefill` makes
    them from the cache (the first page holds ``offset`` invisible slots)."""
    n_layers, h_kv, t, d = keys.shape
    pages = -(-(offset + t) // stride)
    slots = F.pad(keys.float(), (0, 0, offset, pages * stride - offset - t))
    valid = torch.zeros(pages * stride, dtype=torch.bool)
    valid[offset : offset + t] = True
    means = page_means(slots, valid[None].expand(n_layers, -1), stride)
    return means, valid.view(pages, stride).sum(-1)


def student_scores(queries: Tensor, rotary: tuple[Tensor, Tensor] | None, means: Tensor, counts: Tensor, scales: Tensor, geo: Geometry) -> Tensor:
    """``[L, P, H_kv, NB]``: the block scores `Forecast.scores` computes at inference (divided by
    the hidden state's RMS, which decoding leaves out), for every layer and position at once: the
    heads' queries ``[L, P, H_kv, D]`` (before RoPE) rotated with
    the positions' ``rotary [P, D_rot]``, scored against the layer's page means ``[L, H_kv, pages,
    D]`` times ``scales [L]`` (the softmax scale the selecting layer's state holds), windows and
    blocks by `block_scores` with the pages' visible ``counts``."""
    n_layers, p, h_kv, d = queries.shape
    rot = None if rotary is None else tuple(x.to(queries.device).repeat(n_layers, 1) for x in rotary)
    f = rotate(queries.float().flatten(0, 1), rot).unflatten(0, (n_layers, p))
    page_scores = torch.einsum("lphd,lhnd->lphn", f, means.float()) * scales.float()[:, None, None, None]
    c = counts[None].expand(n_layers * p, -1)
    return block_scores(page_scores.flatten(0, 1), c, geo.kernel_pages, geo.block_pages).unflatten(0, (n_layers, p))


class LayerQueries(nn.Module):
    """Every head's query in one forward call: the unit accelerate prepares, so a step makes one
    forward (one autocast region, one DDP forward) however many layers there are."""

    def __init__(self, heads: ForecastHeads) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, inputs: Tensor) -> Tensor:
        """``inputs [L, N, d]`` (head ``i``'s input in row ``i``) → ``[L, N, H_kv, D]``."""
        return torch.stack([self.heads(inputs[i], i) for i in range(inputs.shape[0])])


def oracle_scores(queries: Tensor, means: Tensor, counts: Tensor, scales: Tensor, geo: Geometry) -> Tensor:
    """``[L, P, H_kv, NB]``: the student's scoring fed with each layer's own queries ``[L, H, P, D]``
    (after RoPE, averaged over each GQA group) instead of a head's forecast: what a perfect
    forecast of the group's query would score with the policy's page means and blocks, the
    reference the heads' recall is read against (not a strict bound: a head trained on the teacher
    may rank better than the group's mean query)."""
    n_layers, h, p, d = queries.shape
    h_kv = means.shape[1]
    grouped = queries.reshape(n_layers, h_kv, h // h_kv, p, d).mean(2).permute(0, 2, 1, 3)  # [L, P, H_kv, D]
    return student_scores(grouped, None, means, counts, scales, geo)


# ------------------------------------------------------------------------------------ loss
def forecast_loss(scores: Tensor, teacher: Tensor, candidates: Tensor, k: int) -> Tensor:
    """KL(teacher ‖ student) over the teacher's top-``k`` candidate blocks plus one bucket for the
    rest of the mass, averaged over every leading index (layers, positions, groups).

    ``scores [..., NB]`` are the student's block scores (its distribution is their softmax over the
    candidates), ``teacher [..., NB]`` the teacher's distribution over the candidates,
    ``candidates`` a bool mask broadcastable to them. The bucket keeps the loss about what the
    policy decides (the few best blocks) without ignoring the mass the student puts elsewhere; where
    there are at most ``k`` candidates it is the full KL. Zero exactly when the two agree on the top
    ``k`` and on the rest's total.
    """
    cand = candidates.expand_as(scores)
    k = min(k, scores.shape[-1])
    s = scores.float().masked_fill(~cand, NEG)
    log_z = torch.logsumexp(s, -1, keepdim=True)
    p = teacher.float() * cand
    top = p.masked_fill(~cand, -1.0).topk(k, dim=-1).indices
    in_top = torch.zeros_like(cand).scatter(-1, top, True)
    p_top = p.gather(-1, top)
    logq_top = s.gather(-1, top) - log_z
    p_rest = (p * (cand & ~in_top)).sum(-1, keepdim=True)
    logq_rest = torch.logsumexp(s.masked_fill(in_top | ~cand, NEG), -1, keepdim=True) - log_z
    p_all, logq = torch.cat([p_top, p_rest], -1), torch.cat([logq_top, logq_rest], -1)
    terms = torch.where(p_all > 0, p_all * (p_all.clamp(min=1e-30).log() - logq), 0.0)
    return terms.sum(-1).mean()


def topk_recall(scores: Tensor, teacher: Tensor, candidates: Tensor, k: int) -> tuple[float, int]:
    """``(sum, count)`` of |student top-k ∩ teacher top-k| / k over the candidate blocks, for the
    (layer, position, group) rows with more than ``k`` candidates (with fewer, any choice recalls
    everything, so they would only dilute the measure)."""
    cand = candidates.expand_as(scores)
    rows = cand.sum(-1) > k
    if k >= scores.shape[-1] or not bool(rows.any()):
        return 0.0, 0
    s = scores.float().masked_fill(~cand, -torch.inf)[rows].topk(k, -1).indices
    t = teacher.float().masked_fill(~cand, -1.0)[rows].topk(k, -1).indices
    hits = (s[:, :, None] == t[:, None, :]).any(-1).sum(-1).float() / k
    return float(hits.sum()), int(rows.sum())
