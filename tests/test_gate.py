"""`Gate`: the choice on synthetic curves (crossovers, quality budget, extrapolation, ties), bad
inputs, files, calibration on a tiny model, and a gated Decoder decoding with the chosen setting."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from tiny_models import padded_batch, tiny_model

from policyzoo import AttentionTopK, Decoder, Quest, TopK
from policyzoo.gate import Gate, GateDecision, load_quality

# Linear synthetic curves (ms per step, x = n / 1K): dense 5 + x, proj 3 + x (a fixed saving),
# kv 5 + x/4 (a saving that grows with the context), both 4 + x/4.
K = 1024


def line(a: float, b: float, contexts=(1 * K, 8 * K, 64 * K)) -> dict[int, float]:
    """``a + b · n / 1K`` at ``contexts``."""
    return {n: a + b * n / K for n in contexts}


CURVES = {
    "dense": line(5.0, 1.0),
    "proj": line(3.0, 1.0),
    "kv": line(5.0, 0.25),
    "both": line(4.0, 0.25),
}
QUALITY = {"dense": 0.0, "proj": 0.4, "kv": 0.01, "both": 0.5}


# ------------------------------------------------------------------------------ choice logic
def test_crossovers_of_linear_curves():
    gate = Gate(CURVES)
    # proj beats both below the context where 3 + x = 4 + x/4 (x = 4/3 K tokens); both wins above.
    cross = 4 / 3 * K
    assert gate.choose(cross - 20) == "proj"
    assert gate.choose(cross + 20) == "both"
    assert gate.choose(64 * K) == "both"
    # Without "both", kv overtakes proj where 3 + x = 5 + x/4, x = 8/3 K.
    no_both = Gate({s: c for s, c in CURVES.items() if s != "both"})
    assert no_both.choose(8 / 3 * K - 20) == "proj"
    assert no_both.choose(8 / 3 * K + 20) == "kv"
    assert no_both.predict("proj", 8 / 3 * K) == pytest.approx(no_both.predict("kv", 8 / 3 * K))


def test_interpolation_and_extrapolation():
    gate = Gate({"dense": {1000: 10.0, 2000: 20.0, 4000: 24.0}})
    assert gate.predict("dense", 1500) == pytest.approx(15.0)
    assert gate.predict("dense", 3000) == pytest.approx(22.0)  # linear between measured points
    assert gate.predict("dense", 8000) == pytest.approx(24.0 + 4.0 / 2000 * 4000)  # line of the last two points
    assert gate.predict("dense", 10) == 10.0  # below the first point: its value
    # A noisy last segment that falls is not extrapolated downwards (slope floored at 0).
    falling = Gate({"dense": {1000: 10.0, 2000: 20.0, 4000: 19.0}})
    assert falling.predict("dense", 3000) == pytest.approx(19.5)
    assert falling.predict("dense", 100_000) == 19.0


def test_extrapolation_decides_beyond_the_measured_contexts():
    # Measured only up to 8K, where proj is still faster; extrapolated, kv overtakes it at 12K.
    curves = {"dense": {4 * K: 9.0, 8 * K: 13.0}, "proj": {4 * K: 5.0, 8 * K: 7.0}, "kv": {4 * K: 8.0, 8 * K: 8.5}}
    gate = Gate(curves)
    assert gate.choose(8 * K) == "proj"
    assert gate.predict("proj", 16 * K) == pytest.approx(11.0) and gate.predict("kv", 16 * K) == pytest.approx(9.5)
    assert gate.choose(16 * K) == "kv"
    assert gate.choose(12 * K - 10) == "proj" and gate.choose(12 * K + 10) == "kv"


def test_quality_budget_excludes_settings_and_dense_is_always_allowed():
    gate = Gate(CURVES, quality=QUALITY, max_ppl_increase=0.45)
    # both (0.5) is over the budget: at 64K kv is the fastest allowed.
    assert gate.choose(64 * K) == "kv"
    assert gate.choose(K) == "proj"
    tight = Gate(CURVES, quality=QUALITY, max_ppl_increase=0.005)
    assert {tight.choose(n) for n in (K, 8 * K, 64 * K)} == {"dense"}
    d = tight.explain(64 * K)
    assert d.choice == "dense"
    assert d.excluded == {
        "proj": "ppl increase 0.4 > budget 0.005",
        "kv": "ppl increase 0.01 > budget 0.005",
        "both": "ppl increase 0.5 > budget 0.005",
    }
    assert set(d.predicted_ms) == {"dense", "proj", "kv", "both"}  # excluded settings are still predicted
    # dense stays allowed even when its own measurement (noise) exceeds the budget
    assert Gate(CURVES, quality={**QUALITY, "dense": 0.1}, max_ppl_increase=0.005).choose(K) == "dense"
    # a setting without a measurement is excluded once there is a budget
    partial = Gate(CURVES, quality={"dense": 0.0, "kv": 0.01}, max_ppl_increase=1.0)
    assert partial.choose(64 * K) == "kv"
    assert partial.explain(K).excluded["proj"].startswith("no perplexity measurement")
    # a quality table without a budget constrains nothing
    assert Gate(CURVES, quality=QUALITY).choose(64 * K) == "both"


def test_budget_is_inclusive():
    gate = Gate(CURVES, quality=QUALITY, max_ppl_increase=0.5)
    assert gate.choose(64 * K) == "both"


def test_ties_go_to_the_earlier_setting():
    flat = {s: {K: 5.0, 2 * K: 5.0} for s in ("dense", "proj", "kv", "both")}
    assert Gate(flat).choose(1500) == "dense"
    assert Gate({**flat, "dense": {K: 6.0, 2 * K: 6.0}}).choose(1500) == "proj"
    # at an exact crossover the earlier setting wins
    gate = Gate({"dense": {K: 10.0, 2 * K: 10.0}, "proj": {K: 4.0, 3 * K: 8.0}, "kv": {K: 6.0, 3 * K: 6.0}})
    assert gate.predict("proj", 2 * K) == gate.predict("kv", 2 * K) == 6.0
    assert gate.choose(2 * K) == "proj"


def test_available_settings_restrict_the_choice():
    gate = Gate(CURVES)
    assert gate.choose(64 * K, available=["dense", "proj"]) == "proj"
    d = gate.explain(64 * K, available=("dense", "proj"))
    assert d.excluded["kv"].startswith("not available") and d.excluded["both"].startswith("not available")
    with pytest.raises(ValueError, match="must include 'dense'"):
        gate.choose(K, available=["proj"])
    with pytest.raises(ValueError, match="available setting must be one of"):
        gate.choose(K, available=["dense", "sparse"])
    only_dense_proj = Gate({"dense": CURVES["dense"], "proj": CURVES["proj"]})
    assert only_dense_proj.explain(64 * K).excluded == {"kv": "not calibrated", "both": "not calibrated"}


def test_explain_text():
    d = Gate(CURVES, quality=QUALITY, max_ppl_increase=0.45).explain(32 * K)
    assert isinstance(d, GateDecision)
    text = str(d)
    assert text.splitlines()[0] == "gate at context 32768 tokens (32K): kv"
    assert "both" in text and "excluded: ppl increase 0.5 > budget 0.45" in text and "chosen" in text


@pytest.mark.parametrize(
    ("curves", "message"),
    [
        ({}, "non-empty dict"),
        ({"proj": CURVES["proj"]}, "must include 'dense'"),
        ({**CURVES, "sparse": CURVES["kv"]}, "curves key must be one of"),
        ({"dense": {K: 5.0}}, "at least two contexts"),
        ({"dense": {K: 5.0, 2 * K: -1.0}}, "must be > 0"),
        ({"dense": {K: 5.0, 2 * K: math.nan}}, "finite number"),
        ({"dense": {"1024": 5.0, 1024: 6.0}}, "appears twice"),
        ({"dense": {0: 5.0, 2 * K: 6.0}}, "not a positive whole number"),
        ({"dense": {"4k": 5.0, 2 * K: 6.0}}, "not a positive whole number"),
        ({"dense": 5.0}, "must map contexts to ms"),
    ],
)
def test_bad_curves_are_clear_errors(curves, message):
    with pytest.raises(ValueError, match=message):
        Gate(curves)


def test_bad_quality_and_contexts_are_clear_errors():
    with pytest.raises(ValueError, match="needs a quality table"):
        Gate(CURVES, max_ppl_increase=0.5)
    with pytest.raises(ValueError, match="max_ppl_increase must be >= 0"):
        Gate(CURVES, quality=QUALITY, max_ppl_increase=-0.1)
    with pytest.raises(ValueError, match="max_ppl_increase must be a finite number"):
        Gate(CURVES, quality=QUALITY, max_ppl_increase=math.inf)
    with pytest.raises(ValueError, match="quality key must be one of"):
        Gate(CURVES, quality={"quest": 0.1})
    with pytest.raises(ValueError, match="finite number"):
        Gate(CURVES, quality={"proj": "low"})
    with pytest.raises(ValueError, match="names maps the labels of a results file"):
        Gate(CURVES, quality=QUALITY, names={"kv": "quest"})
    gate = Gate(CURVES)
    for bad in (0, -5, math.nan, math.inf, "4k", True, None):
        with pytest.raises(ValueError, match="context must be a number of tokens"):
            gate.choose(bad)
    with pytest.raises(ValueError, match="setting must be one of"):
        gate.predict("sparse", K)
    with pytest.raises(ValueError, match="was not calibrated"):
        Gate({"dense": CURVES["dense"]}).predict("kv", K)


# ------------------------------------------------------------------------------ quality files
def test_load_quality_from_eval_results(tmp_path):
    rows = [
        {"setting": "dense", "task": "ppl", "ppl_increase": 0.0},
        {"setting": "quest:budget=0.25", "task": "ppl", "length": 1024, "ppl_increase": 0.02},
        {"setting": "quest:budget=0.25", "task": "ppl", "length": 3072, "ppl_increase": 0.05},  # worst counts
        {"setting": "quest:budget=0.25", "task": "passkey", "accuracy": 1.0},  # no ppl: skipped
        {"setting": "topk:0.5", "task": "ppl", "ppl_increase": 0.4},
        {"setting": "quest:budget=0.25 + topk:0.5", "task": "ppl", "ppl_increase": None},  # null: skipped
        {"setting": "window:256", "task": "ppl", "ppl_increase": 3.0},  # names no gate setting: ignored
    ]
    names = {"kv": "quest:budget=0.25", "proj": "topk:0.5", "both": "quest:budget=0.25 + topk:0.5"}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    assert load_quality(path, names) == {"dense": 0.0, "kv": 0.05, "proj": 0.4}
    (tmp_path / "list.json").write_text(json.dumps([{"setting": "kv", "ppl_increase": 0.01}]))
    assert load_quality(tmp_path / "list.json") == {"kv": 0.01}
    gate = Gate(CURVES, quality=path, names=names, max_ppl_increase=0.1)
    assert gate.quality == {"dense": 0.0, "kv": 0.05, "proj": 0.4}
    assert gate.choose(64 * K) == "kv"  # both has no measurement, proj is over budget
    (tmp_path / "plain.json").write_text(json.dumps(QUALITY))
    assert load_quality(tmp_path / "plain.json") == QUALITY
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_quality(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="expected a list of records"):
        load_quality({"setting": "kv"})
    with pytest.raises(ValueError, match="record 0 has no 'setting'"):
        load_quality([{"ppl_increase": 0.1}])
    with pytest.raises(ValueError, match="names key must be one of"):
        load_quality([], names={"quest": "x"})


def test_quality_from_policyzoo_eval_results_matches_settings_by_policy(tmp_path):
    from policyzoo.spec import parse_kv, parse_proj, spec_label

    # What `policyzoo eval` writes (results.json): "settings" with the policies' repr, "rows" per
    # setting × task × length with ppl_increase (None for retrieval tasks).
    grid = [("dense", "none"), ("dense", "topk:0.5"), ("quest:budget=0.25,page=16", "none"),
            ("quest:budget=0.25,page=16", "topk:0.5"), ("window:sinks=4,window=64", "none")]  # fmt: skip
    settings = [{"label": spec_label(k, p), "kv": k, "proj": p, "kv_policy": repr(parse_kv(k)), "proj_policy": repr(parse_proj(p))}
                for k, p in grid]  # fmt: skip
    increases = [0.0, 0.4, 0.01, 0.5, 2.0]
    rows = [{"setting": rec["label"], "task": "ppl", "length": 1024, "ppl_increase": inc} for rec, inc in zip(settings, increases)]
    rows += [{"setting": rec["label"], "task": "passkey", "length": 1024, "ppl_increase": None} for rec in settings]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"settings": settings, "rows": rows, "items": []}))
    kv, proj = parse_kv("quest:budget=0.25,page=16"), parse_proj("topk:0.5")
    assert load_quality(path, kv_spec=repr(kv), proj_spec=repr(proj)) == QUALITY
    gate = Gate(CURVES, quality=path, max_ppl_increase=0.45, kv_spec=repr(kv), proj_spec=repr(proj))
    assert gate.quality == QUALITY and gate.choose(64 * K) == "kv"
    # a gate calibrated with other policies finds only the dense row
    other = Gate(CURVES, quality=path, max_ppl_increase=0.45, kv_spec=repr(Quest(0.5, page=16)), proj_spec=repr(TopK(0.25)))
    assert other.quality == {"dense": 0.0} and other.choose(64 * K) == "dense"


# ------------------------------------------------------------------------------ files
def test_save_load_round_trip(tmp_path):
    gate = Gate(CURVES, quality=QUALITY, max_ppl_increase=0.45, device="NVIDIA H200",
                kv_spec="Quest(budget=0.2)", proj_spec="TopK(keep=0.5)", meta={"steps": 8})  # fmt: skip
    path = gate.save(tmp_path / "gate.json")
    record = json.loads(path.read_text())
    assert record["format"] == "policyzoo-gate/1" and record["device"] == "NVIDIA H200"
    assert record["kv"] == "Quest(budget=0.2)" and record["proj"] == "TopK(keep=0.5)"
    assert record["curves"]["kv"]["8192"] == CURVES["kv"][8 * K]
    back = Gate.load(path)
    assert back.to_dict() == gate.to_dict()
    for n in (10, K, 1500, 3 * K, 20 * K, 64 * K, 1 << 20):
        assert back.explain(n) == gate.explain(n)


def test_bad_gate_files_are_clear_errors(tmp_path):
    path = tmp_path / "gate.json"
    path.write_text("[1, 2")
    with pytest.raises(ValueError, match="not a gate file"):
        Gate.load(path)
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="expected format 'policyzoo-gate/1'"):
        Gate.load(path)
    path.write_text(json.dumps({**Gate(CURVES).to_dict(), "curves": {"dense": {"1024": 1.0}}}))
    with pytest.raises(ValueError, match=r"gate\.json: curves\['dense'\] needs at least two contexts"):
        Gate.load(path)
    with pytest.raises(FileNotFoundError):
        Gate.load(tmp_path / "missing.json")


# ------------------------------------------------------------------------------ Decoder
# Short enough for a tiny model: proj is the fastest up to ~119 tokens, kv beyond.
TINY_CURVES = {
    "dense": {16: 1.0, 1000: 11.0},
    "proj": {16: 0.5, 1000: 10.5},  # fastest up to ~119 tokens
    "kv": {16: 1.5, 1000: 2.0},  # fastest beyond
    "both": {16: 2.0, 1000: 2.5},
}
KV = dict(budget=8, sinks=2, window=2)


def test_gated_decoder_decodes_with_the_chosen_setting():
    model = tiny_model("llama")
    gate = Gate(TINY_CURVES)
    dec = Decoder(model, kv=AttentionTopK(**KV), proj=TopK(0.5), gate=gate)
    assert dec.available_settings() == ("dense", "proj", "kv", "both")
    short, _ = padded_batch(1, 40, seed=1)
    long, _ = padded_batch(1, 150, seed=2)
    assert gate.choose(40 + 6 // 2) == "proj" and gate.choose(150 + 6 // 2) == "kv"

    out_short = dec.generate(short, 6, audit=True)
    assert dec.last_choice == "proj"
    audit = dec.last_audit
    assert audit.mean("kv_keep") == 1.0  # every page: dense attention
    assert audit.mean("proj_keep") == pytest.approx(0.5, abs=0.02)
    out_long = dec.generate(long, 6, audit=True)
    assert dec.last_choice == "kv"
    audit = dec.last_audit
    assert audit.mean("kv_keep") <= 8 / 150 + 1e-6
    assert not audit.proj_keep  # the projections ran dense: nothing to record
    # The same tokens as Decoders fixed to each setting.
    assert torch.equal(out_short, Decoder(copy.deepcopy(model), proj=TopK(0.5)).generate(short, 6))
    assert torch.equal(out_long, Decoder(copy.deepcopy(model), kv=AttentionTopK(**KV)).generate(long, 6))
    # and the short request again, after the long one switched the runtime
    assert torch.equal(dec.generate(short, 6), out_short) and dec.last_choice == "proj"


def test_gated_decoder_offers_only_what_it_has():
    model = tiny_model("qwen3")
    dec = Decoder(model, proj=TopK(0.5), gate=Gate(TINY_CURVES))
    assert dec.available_settings() == ("dense", "proj")
    ids, _ = padded_batch(1, 150)
    assert Gate(TINY_CURVES).choose(150 + 2) == "kv"
    sparse = Decoder(copy.deepcopy(model), proj=TopK(0.5)).generate(ids, 4)
    assert torch.equal(dec.generate(ids, 4), sparse)  # kv would be faster, but there is no KV policy
    assert dec.last_choice == "proj"
    assert dec.gate.explain(152, dec.available_settings()).excluded["kv"].startswith("not available")
    with pytest.raises(ValueError, match="setting must be one of dense, proj for this Decoder"):
        dec.use("kv")
    dense = Decoder(copy.deepcopy(model)).generate(ids, 4)
    assert torch.equal(dec.use("dense").generate(ids, 4), sparse)  # the gate chooses again per call
    # Without a gate the setting stays what it is given or told.
    plain = Decoder(model, kv=Quest(0.5, page=4), proj=TopK(0.5))
    assert plain.setting == "both" and plain.last_choice is None
    plain.generate(ids, 2)
    assert plain.last_choice == "both"
    assert torch.equal(plain.use("dense").generate(ids, 4), dense) and plain.last_choice == "dense"


def test_gate_argument_checks_and_mismatch_warning():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="gate must be a policyzoo.gate.Gate"):
        Decoder(model, gate=TINY_CURVES)
    gate = Gate(TINY_CURVES, kv_spec=repr(Quest(0.25, page=16)), proj_spec=repr(TopK(0.5)), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Decoder(model, kv=Quest(0.25, page=16), proj=TopK(0.5), gate=gate)  # matches: no warning
    with pytest.warns(UserWarning, match="calibrated with kv"):
        Decoder(model, kv=Quest(0.5, page=16), proj=TopK(0.5), gate=gate)


def test_compiled_gated_decoder_recompiles_once_per_choice():
    torch._dynamo.reset()
    model = tiny_model("llama", layers=1)
    short, _ = padded_batch(1, 40, seed=1)
    long, _ = padded_batch(1, 150, seed=2)
    eager = Decoder(copy.deepcopy(model), kv=AttentionTopK(**KV), proj=TopK(0.5), gate=Gate(TINY_CURVES))
    expected = [eager.generate(ids, 5) for ids in (short, long, short)]
    dec = Decoder(model, kv=AttentionTopK(**KV), proj=TopK(0.5), gate=Gate(TINY_CURVES), compile=True)
    from torch._dynamo.utils import counters

    counters.clear()
    got = [dec.generate(ids, 5) for ids in (short, long, short)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert sum(counters["recompiles"].values()) <= 1  # proj, then kv once; proj again replays


# ------------------------------------------------------------------------------ calibration
def test_calibrate_on_a_tiny_model(tmp_path):
    from policyzoo.proj.base import SparseLinear

    model = tiny_model("llama")
    gate = Gate.calibrate(model, kv=AttentionTopK(**KV), proj=TopK(0.5), contexts=[128, 32], steps=2, reps=1,
                          warmup=1, quality=QUALITY, max_ppl_increase=0.45, progress=False)  # fmt: skip
    assert gate.settings == ("dense", "proj", "kv", "both")
    for s in gate.settings:
        contexts, ms = gate.curves[s]
        assert contexts == (32, 128) and all(m > 0 for m in ms)
    assert gate.device == "cpu"
    assert gate.kv_spec == repr(AttentionTopK(**KV)) and gate.proj_spec == repr(TopK(0.5))
    assert gate.meta["steps"] == 2 and gate.meta["batch"] == 1
    assert gate.choose(64) in ("dense", "proj", "kv")  # both is over the quality budget
    assert not any(isinstance(m, SparseLinear) for m in model.modules())  # wrappers removed
    back = Gate.load(gate.save(tmp_path / "gate.json"))
    assert back.to_dict() == gate.to_dict()
    # The calibrated gate drives a Decoder built like the one it measured.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dec = Decoder(model, kv=AttentionTopK(**KV), proj=TopK(0.5), gate=back)
    ids, _ = padded_batch(1, 30)
    dec.generate(ids, 3)
    assert dec.last_choice == back.choose(30 + 1)


def test_calibrate_argument_checks():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="at least two"):
        Gate.calibrate(model, proj=TopK(0.5), contexts=[64], progress=False)
    with pytest.raises(ValueError, match="positive ints"):
        Gate.calibrate(model, proj=TopK(0.5), contexts=[64, 0], progress=False)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        Gate.calibrate(model, proj=TopK(0.5), contexts=[32, 64], steps=0, progress=False)
    with pytest.raises(ValueError, match="need a KV policy"):
        Gate.calibrate(model, proj=TopK(0.5), contexts=[32, 64], settings=["kv"], progress=False)
    gate = Gate.calibrate(model, proj=TopK(0.5), contexts=[32, 64], steps=1, reps=1, warmup=0, progress=False)
    assert gate.settings == ("dense", "proj") and gate.kv_spec is None


def test_calibrate_a_decoder_keeps_it_wrapped_and_restores_its_setting():
    model = tiny_model("llama")
    dec = Decoder(model, kv=AttentionTopK(**KV), proj=TopK(0.5)).use("kv")
    gate = Gate.calibrate(dec, contexts=[32, 64], steps=1, reps=1, warmup=0, progress=False)
    assert gate.settings == ("dense", "proj", "kv", "both") and gate.proj_spec == repr(TopK(0.5))
    assert gate.meta["compile"] is False and gate.meta["warmup"] == 0
    assert dec.setting == "kv" and dec.session.policy is dec.kv and not dec.session.sparse_proj
    ids, _ = padded_batch(1, 20)
    dec.generate(ids, 3, audit=True)
    assert dec.last_audit.proj_keep == {} and dec.last_choice == "kv"
    with pytest.raises(ValueError, match="the Decoder's own"):
        Gate.calibrate(dec, kv=AttentionTopK(**KV), contexts=[32, 64], progress=False)
