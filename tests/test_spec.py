"""policyzoo.spec: policies from strings such as ``quest:budget=256,page=16`` and ``topk:0.5``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from policyzoo import AttentionTopK, Dense, Quest, Threshold, TopK, Window
from policyzoo import spec as spec_mod
from policyzoo.kv.base import KVSelector
from policyzoo.spec import parse_kv, parse_proj, spec_label


def test_documented_kv_forms():
    q = parse_kv("quest:budget=256,page=16")
    assert isinstance(q, Quest) and q.budget == 256 and isinstance(q.budget, int) and q.page == 16
    t = parse_kv("attn-topk:0.25")
    assert isinstance(t, AttentionTopK) and t.budget == 0.25 and isinstance(t.budget, float)
    w = parse_kv("window:sinks=4,window=256")
    assert isinstance(w, Window) and (w.sinks, w.window) == (4, 256)
    assert isinstance(parse_kv("dense"), Dense)
    assert isinstance(parse_kv("none"), Dense)


def test_positional_value_is_the_first_parameter_and_types_are_kept():
    assert parse_kv("quest:256").budget == 256 and isinstance(parse_kv("quest:256").budget, int)
    assert parse_kv("quest:0.1,page=32") == Quest(0.1, page=32)
    assert parse_kv("attn-topk:64,sinks=2,window=8,aggregate=max") == AttentionTopK(64, sinks=2, window=8, aggregate="max")
    assert parse_kv(" Quest : 0.25 ") == Quest(0.25)  # whitespace and class names are accepted
    assert parse_kv("attentiontopk:1.0").budget == 1.0 and isinstance(parse_kv("attentiontopk:1.0").budget, float)


def test_documented_proj_forms(tmp_path):
    p = parse_proj("topk:0.5")
    assert isinstance(p, TopK) and p.keep == 0.5
    assert parse_proj("none") is None and parse_proj("dense") is None
    assert parse_proj("topk:0.25,targets=gate+up+down").targets == ("gate", "up", "down")
    fresh = parse_proj("threshold:0.3")
    assert isinstance(fresh, Threshold) and fresh.keep == 0.3 and not fresh.thresholds
    path = tmp_path / "thr.safetensors"
    Threshold(keep=0.5, targets=("q", "down"), thresholds={"0.q": 0.25, "0.down": 1.5}).save(path)
    loaded = parse_proj(f"threshold:0.5,path={path}")
    assert isinstance(loaded, Threshold) and loaded.keep == 0.5
    assert loaded.thresholds == {"0.q": 0.25, "0.down": 1.5} and loaded.targets == ("q", "down")
    assert parse_proj(f"threshold:path={path}").keep == 0.5
    with pytest.raises(ValueError, match="calibrated for keep=0.5"):
        parse_proj(f"threshold:0.3,path={path}")
    with pytest.raises(ValueError, match="no threshold file"):
        parse_proj(f"threshold:0.5,path={tmp_path / 'missing.safetensors'}")


def test_fast_topk_spec_loads_its_ratios(tmp_path):
    assert parse_proj("topk:0.5,mode=fast").mode == "fast"
    path = TopK(keep=0.4, mode="fast", targets=("gate", "up"), ratios={"0.gate": 0.7, "0.up": 0.7}).save(tmp_path / "f.safetensors")
    loaded = parse_proj(f"topk:mode=fast,path={path}")
    assert isinstance(loaded, TopK) and loaded.mode == "fast" and loaded.keep == 0.4
    assert loaded.ratios == {"0.gate": pytest.approx(0.7), "0.up": pytest.approx(0.7)} and loaded.targets == ("gate", "up")
    assert parse_proj(f"topk:path={path}").mode == "fast"  # the file says which mode
    with pytest.raises(ValueError, match="mode=exact but"):
        parse_proj(f"topk:mode=exact,path={path}")
    with pytest.raises(ValueError, match="no ratios for targets"):
        parse_proj(f"topk:targets=down,path={path}")
    thr = Threshold(keep=0.4, thresholds={"0.q": 1.0}).save(tmp_path / "t.safetensors")
    with pytest.raises(ValueError, match="not a policyzoo fast-TopK file"):
        parse_proj(f"topk:path={thr}")


def test_unknown_names_list_what_is_accepted():
    with pytest.raises(ValueError) as e:
        parse_kv("qwest:0.25")
    msg = str(e.value)
    for name in ("dense", "window", "attn-topk", "quest"):
        assert name in msg
    assert "budget=0.25" in msg and "page=16" in msg  # each policy's parameters and defaults
    with pytest.raises(ValueError) as e:
        parse_proj("top-k:0.5")
    assert "topk" in str(e.value) and "threshold" in str(e.value) and "none" in str(e.value)


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("quest:bogus=1", "unknown parameter 'bogus'"),
        ("quest:1.5", "(0, 1]"),
        ("quest:page=16,0.25", "only the first value may be positional"),
        ("quest:budget=1,budget=2", "given twice"),
        ("window:window=0.5", "window must be an int"),
        ("attn-topk:", "nothing after"),
        ("quest:budget=", "key=value"),
        ("quest:0.25,,page=16", "empty parameter"),
        ("dense:3", "takes no parameters"),
        ("", "non-empty"),
        ("3quest", "bad policy name"),
    ],
)
def test_bad_kv_specs_raise_a_clear_value_error(bad, fragment):
    with pytest.raises(ValueError) as e:
        parse_kv(bad)
    assert fragment in str(e.value)


def test_bad_parameter_errors_list_the_policys_parameters():
    with pytest.raises(ValueError) as e:
        parse_kv("quest:bogus=1")
    assert "quest parameters: budget=0.25, page=16, sinks=4, window=16, aggregate=max" in str(e.value)
    with pytest.raises(ValueError) as e:
        parse_proj("topk:keep=2.0")
    assert "topk parameters: keep=0.5" in str(e.value)
    with pytest.raises(ValueError, match="takes no parameters"):
        parse_proj("none:0.5")
    with pytest.raises(ValueError, match="targets"):
        parse_proj("topk:0.5,targets=gate+nope")


def test_new_policies_register_in_one_line(monkeypatch):
    @dataclass
    class KeyNorm(KVSelector):
        budget: int = 8
        window: int = 2

    monkeypatch.setitem(spec_mod.KV_POLICIES, "keynorm", KeyNorm)
    assert parse_kv("keynorm:16") == KeyNorm(16, 2)
    with pytest.raises(ValueError) as e:
        parse_kv("nope")
    assert "keynorm: budget=8, window=2" in str(e.value)


def test_labels_and_describe():
    assert spec_label("dense", "none") == "dense"
    assert spec_label("dense", "topk:0.5") == "dense + topk:0.5"
    assert spec_label("quest: 0.25", "none") == "quest:0.25"
    assert spec_label("quest:0.25", "topk:0.5") == "quest:0.25 + topk:0.5"
    text = spec_mod.describe()
    assert "attn-topk: budget=0.25" in text and "threshold: keep=0.5" in text and "path (" in text


def test_a_learned_kv_policy_loads_from_a_path_with_its_saved_parameters(monkeypatch, tmp_path):
    from tiny_models import LearnedQuest

    saved = LearnedQuest(0.3, page=8, hidden_size=16, kv_heads=2)
    path = saved.save(tmp_path / "learned.safetensors")
    monkeypatch.setitem(spec_mod.KV_POLICIES, "learned", LearnedQuest)
    loaded = parse_kv(f"learned:path={path}")
    assert loaded == saved and torch.equal(loaded.head.weight, saved.head.weight)
    assert parse_kv(f"learned:budget=0.1,path={path}").budget == 0.1  # the spec's others replace saved ones
    with pytest.raises(ValueError, match="no policy file"):
        parse_kv(f"learned:path={tmp_path / 'missing.safetensors'}")
    with pytest.raises(ValueError, match="do not fit"):
        parse_kv(f"learned:hidden_size=8,path={path}")
    assert "path (a safetensors file written by KVSelector.save" in spec_mod.describe(spec_mod.KV_POLICIES)


def test_page_policies_take_a_rescore_factor():
    assert parse_kv("quest:0.1,rescore=3").rescore == 3.0
    assert parse_kv("entmax-kv:0.1,rescore=2.5").rescore == 2.5
    assert parse_kv("ssa:budget=0.05,sample=0.05,rescore=3").rescore == 3.0
    with pytest.raises(ValueError, match="rescore"):
        parse_kv("quest:0.1,rescore=0.5")
