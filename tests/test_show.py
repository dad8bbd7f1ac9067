"""`policyzoo.eval.show`: the pictures of a policy (and `policyzoo show`), on tiny random models."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from policyzoo import AttentionTopK, Decoder, Quest, Window
from policyzoo import cli
from policyzoo.eval.show import PolicyTrace, draw, kept_runs, page_bounds, show, trace_policy

pytest.importorskip("matplotlib")

LAYERS, HEADS = [0, 1], [0, 3]  # tiny_model: 2 layers, 4 query heads in 2 KV groups


class CharTokenizer:
    """Characters as token ids 1..127 (the tiny model's vocabulary): enough for `assets.passkey_prompt`."""

    class Encoding(dict):
        __getattr__ = dict.__getitem__

    def __call__(self, text, add_special_tokens=True, return_tensors=None, return_offsets_mapping=False):
        ids = [ord(c) % 127 + 1 for c in text]
        enc = self.Encoding(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)
        if return_offsets_mapping:
            enc["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return enc


def prompt(n: int = 120) -> torch.Tensor:
    return torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(0))


def labels(fig) -> list[str]:
    return [ax.get_label() for ax in fig.axes]


@dataclass
class SelectionTrace(PolicyTrace):
    """A `PolicyTrace` that also keeps each chosen head's token mask straight from the selection."""

    masks: list[torch.Tensor] = field(default_factory=list)

    def record_attention(self, layer, q, cache, sel, out, scale, attention="softmax"):
        super().record_attention(layer, q, cache, sel, out, scale, attention)
        if layer in self.layers:
            group = q.shape[1] // cache.keys[layer].shape[1]
            mask = sel.token_mask(cache.keys[layer].shape[2])[0, [h // group for h in self.heads]]
            self.masks.append(mask[:, int(cache.start[0]) : int(cache.length)])


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def page_trace(model):
    return trace_policy(model, None, Quest(0.25, page=8, bound="sketch"), prompt=prompt(), layers=LAYERS, heads=HEADS, steps=3)


def test_token_policy_figure(model):
    fig = show(model, None, "attn-topk:0.25", proj="topk:0.5", prompt=prompt(), layers=LAYERS, heads=HEADS, steps=3)
    maps = [f"attention L{layer} H{head}" for layer in LAYERS for head in HEADS]
    assert labels(fig) == maps + ["colour bar", "dropped mass"]  # a token policy: no bound panel
    title = fig._suptitle.get_text()
    assert title.startswith("attn-topk:0.25 + topk:0.5\n120-token prompt, 3 decode steps") and "projections keep 50%" in title


def test_page_policy_figure_has_its_bounds(page_trace):
    assert page_trace.bounds == ("box", "sketch") and page_trace.steps == 3
    assert labels(draw(page_trace))[-2:] == ["dropped mass", "page bound"]


def test_page_bounds_are_above_the_best_logits(page_trace):
    for (kind, layer), bounds in page_trace.bound.items():
        for bound, best in zip(bounds, page_trace.best[layer]):
            seen = torch.isfinite(best)
            assert seen.any() and torch.equal(seen, torch.isfinite(bound)), kind
            assert (bound[seen] >= best[seen] - 1e-4).all(), kind


def test_kept_entries_are_the_selection_and_the_outline(model):
    trace = SelectionTrace((1,), (0, 3))
    dec = Decoder(model, kv=Quest(0.25, page=8))
    with dec.session.audit(trace):
        dec.generate(prompt(), max_new_tokens=4, eos_token_id=[])
    assert trace.steps == 3
    for kept, mask, probs, delta in zip(trace.kept[1], trace.masks, trace.probs[1], trace.dropped[1]):
        assert torch.equal(kept, mask) and kept.any(-1).all() and not kept.all()
        # δ is the dense mass outside exactly these tokens
        torch.testing.assert_close(1 - (probs * kept).sum(-1), delta[[0, 3]], atol=1e-5, rtol=0)
    ax = next(ax for ax in draw(trace).axes if ax.get_label() == "attention L1 H3")
    outline = np.zeros((trace.steps, trace.kept[1][-1].shape[-1]), dtype=bool)
    for path in ax.collections[-1].get_paths():
        (x0, y0), (x1, _) = path.get_extents().get_points()
        outline[round(y0), round(x0) : round(x1)] = True
    for step, kept in enumerate(trace.kept[1]):
        assert np.array_equal(outline[step, : kept.shape[-1]], kept[1].numpy()) and not outline[step, kept.shape[-1] :].any()


def test_kept_runs():
    mask = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert kept_runs(mask) == [(0, 2), (4, 5), (6, 9)]
    assert kept_runs(torch.zeros(3, dtype=torch.bool)) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layers=[2]), "layers: 2 is not a layer of the model, which has 2 (0..1)"),
        (dict(heads=[0, 4]), "heads: 4 is not a head of the model, which has 4 (0..3)"),
        (dict(heads=[1, 1]), "names a head twice"),
        (dict(layers=[]), "non-empty list"),
        (dict(steps=0), "steps must be an int in 1..64"),
        (dict(bound="box", kv=Window()), "Window's cache keeps no page_min / page_max"),
        (dict(bound="sketch"), "Quest's cache keeps no key_sketch, so there is no sketch page bound"),
        (dict(bound="tight"), "bound must be one of auto, box, sketch, none"),
        (dict(prompt=torch.zeros(2, 5, dtype=torch.long)), "prompt must be one row of token ids"),
        (dict(prompt="text"), "a tokenizer is needed"),
    ],
)
def test_bad_arguments_are_refused_before_the_decode(model, kwargs, message):
    kwargs = {"kv": Quest(0.25), "prompt": prompt(), **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        trace_policy(model, None, kwargs.pop("kv"), **kwargs)


def test_page_bounds_by_policy():
    assert page_bounds(AttentionTopK(0.1)) == () and page_bounds(Quest(0.1)) == ("box",)
    assert page_bounds(Quest(0.1, bound="sketch"), "sketch") == ("sketch",)
    assert page_bounds(Quest(0.1, bound="sketch"), "none") == ()


# ---------------------------------------------------------------------------------------- CLI
def run_cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(["show", *args])
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def tiny_assets(monkeypatch):
    """`policyzoo show --model tiny` loads the tiny model and a character tokenizer; any other name fails."""
    import policyzoo.assets

    def load(name, **kwargs):
        if name != "tiny":
            raise AssertionError(f"the test loaded {name!r}")
        return tiny_model(), CharTokenizer()

    monkeypatch.setattr(policyzoo.assets, "load_model", load)


def test_cli_writes_a_png(tmp_path, tiny_assets):
    out = tmp_path / "quest.png"
    rc, stdout, _ = run_cli(["--kv", "quest:0.25,page=8", "--model", "tiny", "--tokens", "400", "--steps", "2",
                             "--layers", "1", "--heads", "0,2", "--out", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0 and f"wrote {out}" in stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kv", "attn-topk:0.1", "--bound", "box"], "bound='box': AttentionTopK's cache keeps no page_min / page_max"),
        (["--kv", "quest:0.1", "--layers", "5"], "layers: 5 is not a layer of the model, which has 2 (0..1)"),
        (["--kv", "quest:0.1", "--heads", "9"], "heads: 9 is not a head of the model, which has 4 (0..3)"),
        (["--kv", "quest:0.1", "--steps", "100"], "steps must be an int in 1..64"),
        (["--kv", "quest:0.1", "--out", "{tmp}"], "is a directory"),
        (["--kv", "quest:0.1", "--out", "{tmp}/missing/x.png"], "no directory"),
        (["--kv", "quest:0.1", "--out", "{tmp}/x.txt"], "the suffix names no image format"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path, tiny_assets, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "x.png")]
    rc, _, err = run_cli([*args, "--model", "tiny", "--tokens", "400", "--no-progress"])
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("policyzoo show: error: ") and message in err
    assert not (tmp_path / "x.png").exists()


def test_cli_bad_indices_are_argument_errors(tmp_path):
    rc, _, err = run_cli(["--kv", "quest:0.1", "--layers", "1,x", "--out", str(tmp_path / "x.png")])
    assert rc == 2 and "argument --layers: must be comma-separated indices (whole numbers >= 0) such as 3,14, got '1,x'" in err


@pytest.mark.slow
def test_embedded_model_picture():
    """On the embedded model and the passkey prompt, the pass key is found and marked, and a retrieval
    head (layer 14, head 3) puts much of its mass on the needle's sentence."""
    pytest.importorskip("gguf")
    from policyzoo.assets import load_model

    model, tokenizer = load_model()
    trace = trace_policy(model, tokenizer, "quest:0.1,bound=sketch", n_tokens=256, layers=[14], heads=[3], steps=1)
    assert len(trace.needle) == 10  # the 5-digit key, twice
    needle = trace.probs[14][0][0, trace.needle[0] - 4 : trace.needle[-1] + 4]
    assert needle.sum() > 0.3
    assert labels(draw(trace))[-1] == "page bound" and trace.bounds == ("box", "sketch")
