"""`Selection`: what a KV policy hands the attention kernel.

One selection per (batch row, KV head), never per query head: every query head of a GQA group reads
the same keys, so grouped-query attention keeps its bandwidth saving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


# The axes along which a selection may be reused (`Selection.reuse` codes them as 1 + index).
REUSE_AXES = ("time", "layer")


@dataclass
class Selection:
    """The cache entries one decode step attends to.

    Attributes:
        indices: ``int32[B, H_kv, K_max]``: token positions (``block == 1``) or page ids
            (``block == P``). Entries at or past ``count`` are padding and never read.
        count: ``int32[B, H_kv]``: number of valid entries in ``indices``.
        log_weight: optional ``float32[B, H_kv, K_max]`` added to the attention logits of each entry
            (Horvitz–Thompson or importance corrections); ``None`` means zero.
        block: tokens per entry: 1 for token selections, the page size for page selections, or a
            multiple of it for a policy that chooses blocks of pages (`kv.Forecast`); entry ``i``
            covers slots ``indices[i]·block ..`` up to ``block`` of them.
        reuse: optional ``int8[B, H_kv]`` provenance for the audit: ``0`` where the entries were
            chosen this step, else ``1 + REUSE_AXES.index(axis)`` where they are an earlier
            selection reused (`kv.PrHS`: ``"time"``, this layer's previous step; ``"layer"``, the
            layer below). The attention kernels ignore it.
    """

    indices: Tensor
    count: Tensor
    log_weight: Tensor | None = None
    block: int = 1
    reuse: Tensor | None = None

    @property
    def k_max(self) -> int:
        return self.indices.shape[-1]

    def split(self, block: int) -> "Selection":
        """The same tokens as entries of ``block`` tokens (a divisor of this selection's block): each
        entry becomes ``self.block // block`` consecutive ones. Returns ``self`` when the blocks agree."""
        if block == self.block:
            return self
        if block < 1 or self.block % block:
            raise ValueError(f"blocks of {self.block} tokens do not split into blocks of {block}")
        m = self.block // block
        offs = torch.arange(m, device=self.indices.device, dtype=self.indices.dtype)
        indices = (self.indices.unsqueeze(-1) * m + offs).flatten(-2)
        log_weight = None if self.log_weight is None else self.log_weight.repeat_interleave(m, dim=-1)
        return Selection(indices, self.count * m, log_weight, block, self.reuse)

    def entry_valid(self) -> Tensor:
        """``bool[B, H_kv, K_max]``: which entries of ``indices`` are real (slot < count)."""
        slots = torch.arange(self.k_max, device=self.indices.device)
        return slots < self.count.unsqueeze(-1)

    def token_positions(self) -> tuple[Tensor, Tensor]:
        """Expand pages into token positions.

        Returns ``(positions int64[B, H_kv, K_max*block], entry_valid bool[...])``; ``entry_valid``
        only says the entry is within ``count`` (the caller still masks positions outside the
        sequence, e.g. the unwritten tail of the last page or left padding).
        """
        idx = self.indices.long()
        valid = self.entry_valid()
        if self.block == 1:
            return idx, valid
        offs = torch.arange(self.block, device=idx.device)
        pos = (idx.unsqueeze(-1) * self.block + offs).flatten(-2)
        return pos, valid.unsqueeze(-1).expand(*valid.shape, self.block).flatten(-2)

    def kept_tokens(self, token_valid: Tensor) -> Tensor:
        """``float[B, H_kv]``: number of real tokens selected, given ``token_valid bool[B, N]``."""
        pos, valid = self.token_positions()
        n = token_valid.shape[-1]
        in_seq = torch.gather(
            token_valid.unsqueeze(1).expand(-1, pos.shape[1], -1), 2, pos.clamp(0, n - 1)
        )
        return (valid & in_seq).sum(-1).float()

    def token_mask(self, n: int) -> Tensor:
        """``bool[B, H_kv, n]``: which of ``n`` cache slots the selection covers (within ``count``)."""
        pos, valid = self.token_positions()
        mask = torch.zeros(*pos.shape[:2], n + 1, dtype=torch.bool, device=pos.device)
        # Invalid entries scatter into the spare slot ``n``, which is dropped.
        return mask.scatter_(2, torch.where(valid, pos.clamp(0, n), n), True)[..., :n]
