"""Run 38 (CPU): what the half2 method's slack does to the sketch's ranking. `policyzoo eval` with the
reference's token bound raised by half2's slack, ``15·slack_factor(D)·Σ_i |q_i|·step_i`` per page
and query head (the kernel's bound sits between the reference's and twice that above it, about once
that on random keys), so that `Quest(0.1, bound="sketch")` ranks as the half2 kernel would. From the
repository root:

    python benchmarks/results/2026-12-07-h100-run38/slack_eval.py eval --kv quest:0.1,bound=sketch ... --out DIR
"""
import sys

import torch

from policyzoo.cli import main
from policyzoo.kernels.ops.sketch_page_bound import reference

SLACK = 9.1 * 2.0**-11  # half2.slack_factor without its D·2^-24 (the half2 module needs triton)
exact = reference.sketch_token_bound


def with_slack(q, codes, page_min, page_max, scale):
    bound = exact(q, codes, page_min, page_max, scale)  # [B, H, N]
    b, h, d = q.shape
    h_kv, n_pages = page_min.shape[1], page_min.shape[2]
    step = reference.sketch_grid(page_min, page_max)[1]  # [B, H_kv, P, D]
    weights = torch.einsum("bkgd,bkpd->bkgp", q.float().abs().view(b, h_kv, h // h_kv, d), step)
    slack = 15 * (SLACK + d * 2.0**-24) * scale * weights.reshape(b, h, n_pages)
    return bound + slack.repeat_interleave(bound.shape[-1] // n_pages, dim=-1)


reference.sketch_token_bound = with_slack
sys.exit(main(sys.argv[1:]))
