"""`compare`: a teacher-forced audit of a Decoder against dense decoding, step by step."""

from __future__ import annotations

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .._compat import attn_implementation
from ..attention import ATTN_IMPLEMENTATION
from .audit import Audit
from .metrics import logits_kl, top1_agreement


@torch.no_grad()
def compare(dec, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None = None, progress: bool = False) -> Audit:
    """Decode along the dense trajectory and measure what the policy changes at every step.

    Each step runs the Decoder's policy and projections on the current token (recording dropped
    mass, output error and kept fractions per layer and KV head), then a dense pass on the same token
    at the same cache slot, whose keys and values replace the sparse ones: both passes always see the
    dense history, so the per-step logits KL and top-1 agreement isolate the policy's own error.
    The next token is the dense greedy choice.
    """
    input_ids, attention_mask = dec._check_inputs(input_ids, attention_mask)
    b, t = input_ids.shape
    runtime = dec.runtime
    audit = Audit()
    start = (attention_mask == 0).sum(1)
    try:
        with attn_implementation(dec.model, ATTN_IMPLEMENTATION):
            dec._prepare_cache(b, t + max_new_tokens, start, t)
            logits = dec._prefill(input_ids, start)
            for _ in tqdm(range(max_new_tokens - 1), desc="compare", disable=not progress, leave=False):
                token = logits.argmax(-1)[:, None]
                runtime.phase, runtime.audit = "decode", audit
                sparse = dec._decode_step(token)
                runtime.phase, runtime.audit = "dense_decode", None
                logits = dec._decode_step(token, advance=False)
                audit.logits_kl.append(logits_kl(logits, sparse).cpu())
                audit.top1_agree.append(top1_agreement(logits, sparse).cpu())
    finally:
        runtime.phase, runtime.audit = "idle", None
    return audit
