"""`TokenOutbox`: step reports delivered in order, and nothing after the step that finished every row."""

from __future__ import annotations

import pytest
import torch

from tiny_models import RecordingStreamer

from policyzoo.streaming import TokenOutbox


def test_reports_reach_the_streamer_in_order_and_stop_after_every_row_finished():
    rec, ticks = RecordingStreamer(), []
    box = TokenOutbox(batch=2, steps=6, device=torch.device("cpu"), streamer=rec, on_token=lambda: ticks.append(1))
    reports = [[5, 7, 0], [6, 2, 0], [1, 2, 1], [0, 0, 1]]  # tokens of 2 rows, then "all finished"
    for i, r in enumerate(reports):
        box.push(torch.tensor(r))
        if i < 2:
            assert box.ready_for_next()  # on the CPU a pushed step is read at once
    assert not box.ready_for_next()  # step 2 finished every row
    box.collect(box.pushed - 1)
    assert [c.tolist() for c in rec.chunks] == [[5, 7], [6, 2], [1, 2]] and len(ticks) == 3
    assert box.tokens().tolist() == [[5, 6, 1], [7, 2, 2]]  # the step after the end is dropped


def test_an_outbox_holds_as_many_steps_as_it_was_made_for():
    box = TokenOutbox(batch=1, steps=1, device=torch.device("cpu"))
    box.push(torch.tensor([3, 0]))
    with pytest.raises(RuntimeError, match="holds 1 steps"):
        box.push(torch.tensor([4, 0]))
    assert box.collect(0) is False and box.tokens().tolist() == [[3]]
