"""Contract tests of `policyzoo.kv.base` (budgets, parameter checks, the selector protocol, learned
parts) and of `Dense`."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo.kernels import reference
from policyzoo.kv import SSA, Certified, Dense, KVSelector, PrHS, Quest
from policyzoo.kv.base import Budget, check_budget, check_count

SETTINGS = settings(max_examples=50, deadline=None)



# ------------------------------------------------------------------------------------ budgets
def test_budget_kinds():
    assert Budget(0.5).is_ratio and not Budget(3).is_ratio
    assert not Budget(1).is_ratio and Budget(1.0).is_ratio  # 1 token vs the whole context
    assert Budget(0.5).k_max(10) == 5 and Budget(0.01).k_max(10) == 1 and Budget(1.0).k_max(7) == 7
    assert Budget(3).k_max(10) == 3 and Budget(30).k_max(10) == 10
    n = torch.tensor([0, 1, 7, 10])
    assert Budget(0.5).count(n).tolist() == [0, 1, 4, 5]
    assert Budget(3).count(n).tolist() == [3, 3, 3, 3]
    assert Budget(0.5).count(n).dtype == torch.long
    assert Budget(0.07).count(torch.tensor([100])).tolist() == [7]  # 0.07 * 100 = 7.000000000000001 in floats


@SETTINGS
@given(ratio=st.floats(1e-6, 1.0), capacity=st.integers(1, 5000), data=st.data())
def test_ratio_budget_count_and_width(ratio, capacity, data):
    n = data.draw(st.lists(st.integers(0, capacity), min_size=1, max_size=4))
    b = Budget(ratio)
    counts = b.count(torch.tensor(n))
    assert counts.tolist() == [math.ceil(ratio * x - 1e-9) for x in n]
    assert 1 <= b.k_max(capacity) <= capacity
    assert bool((counts <= b.k_max(capacity)).all())  # the static width always holds the count


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.0000001, 2.0, float("nan"), float("inf"), -float("inf")])
def test_ratio_outside_unit_interval(bad):
    with pytest.raises(ValueError, match="budget"):
        Budget(bad)
    with pytest.raises(ValueError, match="my_keep"):
        check_budget(bad, "my_keep")


@pytest.mark.parametrize("bad", [0, -1, -100])
def test_non_positive_token_budget(bad):
    with pytest.raises(ValueError, match="budget"):
        Budget(bad)
    with pytest.raises(ValueError, match="tokens_arg"):
        check_budget(bad, "tokens_arg")


@pytest.mark.parametrize("bad", [True, False, "0.5", "8", None, [4], torch.tensor(4)])
def test_budget_wrong_type(bad):
    with pytest.raises(TypeError, match="budget"):
        Budget(bad)
    with pytest.raises(TypeError, match="xyz"):
        check_budget(bad, "xyz")


def test_check_count():
    check_count(0, "sinks")
    check_count(3, "window", minimum=1)
    with pytest.raises(ValueError, match="window"):
        check_count(0, "window", minimum=1)
    with pytest.raises(ValueError, match="sinks"):
        check_count(-1, "sinks")
    for bad in (1.0, True, "2", None):
        with pytest.raises(TypeError, match="sinks"):
            check_count(bad, "sinks")


def test_two_stage_sees_through_wrappers():
    assert Quest(0.1, rescore=2).two_stage and Certified(Quest(0.1, rescore=2)).two_stage
    assert PrHS(SSA(0.1, 0.1, rescore=2), time=0.9).two_stage
    assert not Quest(0.1).two_stage and not Dense().two_stage and not Certified(Quest(0.1)).two_stage



def test_selector_base_is_abstract():
    with pytest.raises(NotImplementedError):
        KVSelector().select(None, torch.zeros(1, 1, 8))


# ------------------------------------------------------------------------------------- Dense
@SETTINGS
@given(data=st.data())
def test_dense_selects_every_visible_page(data, cases, contract):
    case = data.draw(cases())
    sel = Dense().select(case.state(), case.q)
    assert sel.block == case.page and sel.log_weight is None
    contract.check_entries(sel, case, 0, 0, pages=True)
    for r in range(case.b):
        for hk in range(case.h_kv):
            assert sorted(contract.selected(sel, r, hk)) == case.visible_pages(r)
    contract.check_error_bound(sel, case)  # delta = 0: exact
    tv = case.cache.token_valid()
    p = reference.dense_probs(case.q, case.cache.keys[0], case.cache.start, case.cache.length, case.scale)
    from policyzoo.eval.metrics import dropped_mass

    torch.testing.assert_close(dropped_mass(p, sel, tv), torch.zeros(case.b, case.h), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- learned parameters
def test_a_policy_without_modules_has_no_learned_parameters(tmp_path):
    from policyzoo import Quest

    q = Quest(0.25)
    assert q.modules() == {} and list(q.parameters()) == [] and q.state_dict() == {}
    assert q.to(dtype=torch.float64) is q
    with pytest.raises(ValueError, match="no learned parameters"):
        q.save(tmp_path / "q.safetensors")


def test_learned_parts_save_and_load_with_their_parameters(tmp_path):
    from tiny_models import LearnedQuest

    policy = LearnedQuest(0.3, page=4, hidden_size=64, kv_heads=2)
    assert set(policy.modules()) == {"head"} and set(policy.state_dict()) == {"head.weight", "head.bias"}
    path = policy.save(tmp_path / "learned.safetensors")
    back = LearnedQuest.load(path)
    assert back == policy  # the dataclass parameters
    for key, value in policy.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)
    assert LearnedQuest.load(path, budget=0.5).budget == 0.5  # overrides replace saved parameters
    with pytest.raises(ValueError, match="do not fit"):
        LearnedQuest.load(path, hidden_size=32)  # the head's shape follows the parameters
    with pytest.raises(ValueError, match="holds a LearnedQuest policy, not Quest"):
        from policyzoo import Quest

        Quest.load(path)
    with pytest.raises(FileNotFoundError, match="no policy file"):
        LearnedQuest.load(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="no learned part 'tail'"):
        policy.load_state_dict({"tail.weight": torch.zeros(1)})


def test_the_decoder_moves_learned_parameters_to_the_model_and_loaded_weights_decode_alike(tmp_path):
    from tiny_models import LearnedQuest, padded_batch, tiny_model

    from policyzoo import Decoder

    model = tiny_model("llama").to(torch.bfloat16)
    policy = LearnedQuest(0.25, page=4, sinks=1, window=4, hidden_size=64, kv_heads=2)
    torch.nn.init.normal_(policy.head.weight, std=2.0)
    dec = Decoder(model, kv=policy)
    assert all(p.dtype == torch.bfloat16 for p in policy.parameters())
    ids, mask = padded_batch(2, 64)
    out = dec.generate(ids, 6, attention_mask=mask)
    loaded = LearnedQuest.load(policy.save(tmp_path / "p.safetensors"))
    assert torch.equal(Decoder(model, kv=loaded).generate(ids, 6, attention_mask=mask), out)
    torch.nn.init.zeros_(loaded.head.weight)  # other weights: another selection, other tokens
    torch.nn.init.zeros_(loaded.head.bias)
    plain = Decoder(model, kv=loaded).generate(ids, 6, attention_mask=mask)
    assert not torch.equal(plain, out)
