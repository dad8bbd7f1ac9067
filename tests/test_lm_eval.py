"""The lm-eval integration (`policyzoo.integrations.lm_eval`, `.ruler`): the registered ``policyzoo``
model, its three request types against the dense model, its argument errors, and RULER offline.

The fast tests need no model; the ``slow`` ones use the embedded SmolLM2-135M. Every test that
runs lm-eval blocks the network (`no_network`): a connection attempt fails the test.
"""

from __future__ import annotations

import math
import socket
import sys
from pathlib import Path

import pytest
import torch

import lm_eval
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from policyzoo import Quest
from policyzoo.integrations import ruler
from policyzoo.integrations.lm_eval import PolicyzooLM


@pytest.fixture
def no_network(monkeypatch):
    """Internet sockets refuse to connect; the attempts are listed (the test asserts there were none)."""
    attempts: list = []
    connect = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise OSError(f"the test blocks the network (connect to {address})")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    return attempts


@pytest.fixture(scope="session")
def ruler_dir(tmp_path_factory):
    """RULER's offline files, written once for the session."""
    return tmp_path_factory.mktemp("ruler")


@pytest.fixture(scope="module")
def embedded():
    from policyzoo.assets import load_model

    return load_model()


def make_lm(embedded, **args) -> PolicyzooLM:
    """A `PolicyzooLM` on the shared embedded model (each takes the model over from the last)."""
    model, tok = embedded
    return PolicyzooLM(pretrained=model, tokenizer=tok, device="cpu", **args)


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def dense_logprob(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The reference: one forward of the model itself over context + continuation."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    target = torch.tensor(continuation)
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


TEXT = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    "One of the special magic numbers for quiet-river is: 4417293. The grass is green. The sky is blue. "
)


# ------------------------------------------------------------------------------------ registration
def test_the_model_is_registered_under_its_name():
    assert get_model("policyzoo") is PolicyzooLM


def test_the_package_declares_lm_evals_entry_point():
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="lm_eval.models")}
    assert found.get("policyzoo") == "policyzoo.integrations.lm_eval:PolicyzooLM"


# ---------------------------------------------------------------------------------- argument errors
@pytest.mark.parametrize(
    "args, name",
    [
        ({"kv": "quest:0.1", "bound": "sketch"}, "bound"),  # a spec split at its comma by lm-eval's k=v parser
        ({"revision": "main"}, "revision"),
        ({"kv": "nosuchpolicy:0.1"}, "kv"),
        ({"kv": "quest:budget=0.1,nope=3"}, "kv"),
        ({"kv": 3}, "kv"),
        ({"proj": "topk:keep=2.0"}, "proj"),
        ({"proj": "nosuch"}, "proj"),
        ({"dtype": "float8"}, "dtype"),
        ({"batch_size": "auto"}, "batch_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_gen_toks": -1}, "max_gen_toks"),
        ({"max_length": 1}, "max_length"),
        ({"device": "nodevice:3"}, "device"),
        ({"compile": "yes"}, "compile"),
        ({"pretrained": 7}, "pretrained"),
        ({"tokenizer": 7}, "tokenizer"),
    ],
)
def test_bad_model_args_are_refused_by_name(args, name):
    with pytest.raises((TypeError, ValueError), match=name):
        PolicyzooLM(**args)


def test_a_model_object_needs_its_tokenizer():
    from tiny_models import tiny_model

    with pytest.raises(ValueError, match="tokenizer"):
        PolicyzooLM(pretrained=tiny_model(), device="cpu")


# ------------------------------------------------------------------------------------ loglikelihood
@pytest.mark.slow
def test_dense_loglikelihood_equals_the_models_own_log_probs(embedded):
    model, tok = embedded
    lm = make_lm(embedded, batch_size=3)
    pairs = [(TEXT, " 4417293."), (TEXT[:60], " The sky is"), ("The grass is", " green."), ("", "The grass is green.")]
    got = lm.loglikelihood(requests("loglikelihood", pairs))
    assert lm.decoder.kv is None
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        if context:
            ctx, cont = lm._encode_pair(context, continuation)
        else:  # lm-eval's rule: an empty context is the EOS token
            ctx, cont = [lm.eot_token_id], tok.encode(continuation)
        want, want_greedy = dense_logprob(model, ctx, cont)
        assert logprob == pytest.approx(want, abs=2e-3 * len(cont)), (context[:20], continuation)
        assert greedy == want_greedy


@pytest.mark.slow
def test_a_small_budget_changes_the_loglikelihood_and_keeps_it_finite(embedded):
    pairs = [(TEXT * 3, " 4417293."), (TEXT * 2, " The grass is green. The sky is blue.")]
    dense = make_lm(embedded, batch_size=2).loglikelihood(requests("loglikelihood", pairs))
    lm = make_lm(embedded, kv="window:sinks=4,window=8", batch_size=2)
    sparse = lm.loglikelihood(requests("loglikelihood", pairs))
    assert type(lm.decoder.kv).__name__ == "Window"
    for (d, _), (s, _) in zip(dense, sparse):
        assert math.isfinite(s) and s < 0
        assert abs(s - d) > 1e-2  # 12 of about 100 tokens seen: a different score
    quest = make_lm(embedded, kv=Quest(budget=16, page=16), batch_size=2).loglikelihood(requests("loglikelihood", pairs))
    assert all(math.isfinite(s) for s, _ in quest) and any(abs(s - d) > 1e-3 for (s, _), (d, _) in zip(quest, dense))


@pytest.mark.slow
def test_rolling_loglikelihood_is_the_texts_dense_log_prob(embedded):
    model, _ = embedded
    text = "The grass is green. The sky is blue. The sun is yellow."
    lm = make_lm(embedded)
    (total,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    want, _ = dense_logprob(model, [lm.prefix_token_id], lm.tok_encode(text))
    assert total == pytest.approx(want, abs=0.02)
    # Windows of 6 tokens: each token is still scored once, from a shorter context.
    (windowed,) = make_lm(embedded, max_length=6).loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert math.isfinite(windowed) and windowed != pytest.approx(total, abs=1e-3)


@pytest.mark.slow
def test_a_continuation_longer_than_max_length_is_an_error(embedded):
    lm = make_lm(embedded, max_length=8)
    with pytest.raises(ValueError, match="max_length"):
        lm.loglikelihood(requests("loglikelihood", [("The grass", " is green. The sky is blue. The sun is yellow.")]))


@pytest.mark.slow
def test_max_length_beyond_the_models_positions_is_refused(embedded):
    with pytest.raises(ValueError, match="max_length"):
        make_lm(embedded, max_length=10**6)


# ------------------------------------------------------------------------------------- generation
@pytest.mark.slow
def test_generate_until_stops_at_a_stop_string(embedded, monkeypatch):
    lm = make_lm(embedded)
    prompt = "The grass is green. The sky is blue. The sun is yellow. The grass is green. The sky is"
    (free,) = lm.generate_until(requests("generate_until", [(prompt, {"until": [], "max_gen_toks": 16})]))
    # A stop string that is one generated token's text, past the first few: the row can end there.
    tokens = lm.tok_encode(free)
    stop = next(t for t in (lm.tok_decode([i]).strip() for i in tokens[3:12]) if len(t) >= 2)
    calls = []
    generate = lm.decoder.generate

    def recorded(input_ids, **kwargs):
        out = generate(input_ids, **kwargs)
        calls.append(out.shape[1] - input_ids.shape[1])
        return out

    monkeypatch.setattr(lm.decoder, "generate", recorded)
    (cut,) = lm.generate_until(requests("generate_until", [(prompt, {"until": [stop], "max_gen_toks": 16})]))
    assert cut == free.split(stop)[0] and len(cut) < len(free)
    assert calls and calls[0] < 16  # the row ended at the stop token, not at max_gen_toks


@pytest.mark.slow
def test_generate_until_batches_left_padded_prompts_like_single_ones(embedded):
    prompts = [("The grass is green. The sky is", {"until": ["\n"], "max_gen_toks": 6}),
               ("Once upon a time, in a land far away, there lived a", {"until": ["\n"], "max_gen_toks": 6})]  # fmt: skip
    batched = make_lm(embedded, batch_size=2).generate_until(requests("generate_until", prompts))
    single = make_lm(embedded, batch_size=1).generate_until(requests("generate_until", prompts))
    assert batched == single and all(batched)


@pytest.mark.slow
def test_unsupported_generation_kwargs_are_refused(embedded):
    lm = make_lm(embedded)
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate_until(requests("generate_until", [("Hello", {"until": [], "num_beams": 4})]))


# ------------------------------------------------------------------------------------ RULER offline
def test_offline_ruler_serves_essays_and_a_sentence_model_then_undoes_both(ruler_dir, no_network):
    import nltk

    with ruler.offline_ruler(ruler_dir) as metadata:
        from lm_eval.tasks.ruler import prepare_niah

        assert prepare_niah.get_haystack("essay") == ruler.essay_words()
        assert "green" in prepare_niah.get_haystack("repeat")  # RULER's own
        assert len(nltk.sent_tokenize("It works. It really does. Twice!")) == 3
        tokenizer = metadata["tokenizer"]
    assert Path(tokenizer).is_dir() and Path(tokenizer).parent == ruler_dir
    assert prepare_niah.get_haystack.__module__ == "lm_eval.tasks.ruler.prepare_niah"
    assert all(str(ruler_dir) not in p for p in nltk.data.path)
    assert no_network == []


@pytest.mark.slow
def test_ruler_niah_single_1_runs_offline_through_the_policy(ruler_dir, no_network):
    """lm-eval's own RULER task, end to end: its samples made from the embedded tokenizer, decoded
    by the policyzoo model with Quest, scored by RULER's metric, with no network."""
    with ruler.offline_ruler(ruler_dir) as metadata:
        results = lm_eval.simple_evaluate(
            model="policyzoo", model_args={"pretrained": "smollm2-135m", "kv": "quest:0.1", "device": "cpu"},
            tasks=["niah_single_1"], limit=2, metadata={**metadata, "max_seq_lengths": [1024]}, log_samples=True,
        )  # fmt: skip
    score = results["results"]["niah_single_1"]["1024,none"]
    assert 0.0 <= score <= 1.0
    assert results["n-samples"]["niah_single_1"]["effective"] == 2
    assert len(results["samples"]["niah_single_1"]) == 2
    assert results["config"]["kv_policy"] == "Quest" and results["config"]["kv"] == "quest:0.1"
    assert all(len(s["doc"]["input"]) > 2000 for s in results["samples"]["niah_single_1"])  # about 1K tokens each
    assert no_network == []


def test_the_command_line_runs_lm_eval_offline_with_the_embedded_tokenizer(monkeypatch, no_network):
    """``policyzoo-lm-eval`` parses lm_eval's arguments (a quoted spec keeps its commas) and runs
    them with the embedded tokenizer as RULER's ``tokenizer`` metadata and the essays served."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.tasks.ruler import prepare_niah

    from policyzoo.integrations import lm_eval as integration

    seen = []
    monkeypatch.setattr(HarnessCLI, "execute", lambda self, args: seen.append((args, prepare_niah.get_haystack("essay"))))
    monkeypatch.setattr(sys, "argv", ["policyzoo-lm-eval"])
    integration.main([
        "--model", "policyzoo", "--model_args", 'pretrained=smollm2-135m,kv="quest:0.1,bound=sketch"',
        "--tasks", "niah_single_1", "--metadata", '{"max_seq_lengths": [2048]}',
    ])  # fmt: skip
    (args, essays), = seen
    assert args.model_args == {"pretrained": "smollm2-135m", "kv": "quest:0.1,bound=sketch"}
    assert args.metadata["max_seq_lengths"] == [2048] and Path(args.metadata["tokenizer"]).is_dir()
    assert essays == ruler.essay_words()
    assert no_network == []
