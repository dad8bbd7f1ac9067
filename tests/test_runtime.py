"""`Runtime`: the decode state the model's hooks read."""

import pytest

from policyzoo.kv import Dense, EntmaxKV
from policyzoo.runtime import Runtime, attention_of


def test_runtime_attention_follows_the_policy():
    entmax = EntmaxKV(budget=1.0, mode="topk", attention="entmax", page=4)
    assert Runtime(policy=Dense()).attention == "softmax"
    assert Runtime(policy=entmax).attention == "entmax"
    assert Runtime(policy=Dense(), attention="entmax").attention == "entmax"  # the model's, given outright
    with pytest.raises(ValueError, match="attention"):
        Runtime(policy=Dense(), attention="sparsemax")


def test_attention_of_rejects_a_policy_with_an_unknown_attention():
    bad = Dense()
    bad.attention = "sparsemax"
    assert attention_of(Dense()) == "softmax"
    with pytest.raises(ValueError, match="Dense.attention"):
        attention_of(bad)
