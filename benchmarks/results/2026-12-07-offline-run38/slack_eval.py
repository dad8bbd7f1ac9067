"""Run 38 (CPU): what the half2 method's slack does to the sketch's ranking. `policyzoo eval` with the
reference's token bound raised by half2's slack (`reference.half2_slack`, ``15·half2_slack_factor(D)·Σ_i |q_i|·step_i`` per page
and query head; the kernel's bound sits between the reference's and twice that above it, about once
that on random keys), so that `Quest(0.1, bound="sketch")` ranks as the half2 kernel would. From the
repository root:

    python benchmarks/results/2026-12-07-offline-run38/slack_eval.py eval --kv quest:0.1,bound=sketch ... --out DIR
"""
import sys

from policyzoo.cli import main
from policyzoo.kernels.ops.sketch_page_bound import reference

exact = reference.sketch_token_bound


def with_slack(q, codes, page_min, page_max, scale):
    bound = exact(q, codes, page_min, page_max, scale)  # [B, H, N]
    slack = reference.half2_slack(q, page_min, page_max, scale)  # [B, H, P]
    return bound + slack.repeat_interleave(bound.shape[-1] // page_min.shape[2], dim=-1)


reference.sketch_token_bound = with_slack
sys.exit(main(sys.argv[1:]))
