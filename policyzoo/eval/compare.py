"""`compare`: a teacher-forced audit of a Decoder against dense decoding, step by step."""

from __future__ import annotations

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .audit import Audit
from .metrics import logits_kl, top1_agreement


@torch.no_grad()
def compare(dec, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None = None, progress: bool = False) -> Audit:
    """Decode along the dense trajectory and measure what the policy changes at every step.

    Each step runs the Decoder's policy and projections on the current token (recording dropped
    mass, output error and kept fractions per layer and KV head), then a dense pass on the same token
    at the same cache slot (`DecodeSession.redo_dense`), whose keys and values replace the sparse
    ones: both passes always see the dense history, so the per-step logits KL and top-1 agreement
    isolate the policy's own error. The next token is the dense greedy choice.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be an int >= 2 (the first token comes from the prefill), got {max_new_tokens!r}")
    session = dec.session
    audit = Audit()
    logits = session.prefill(input_ids, attention_mask, capacity=input_ids.shape[1] + max_new_tokens)[:, -1]
    for _ in tqdm(range(max_new_tokens - 1), desc="compare", disable=not progress, leave=False):
        token = logits.argmax(-1)
        with session.audit(audit):
            sparse = session.step(token)
        logits = session.redo_dense(token)
        audit.logits_kl.append(logits_kl(logits, sparse).cpu())
        audit.top1_agree.append(top1_agreement(logits, sparse).cpu())
    return audit
