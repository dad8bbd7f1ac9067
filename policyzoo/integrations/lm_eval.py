"""The ``policyzoo`` model of EleutherAI's lm-evaluation-harness: any causal LM decoded through a
`policyzoo.Decoder` with a KV policy and a projection sparsifier (``pip install "policyzoo[lm-eval]"``).

    lm_eval.simple_evaluate(model="policyzoo",
                            model_args={"pretrained": "smollm2-135m", "kv": "quest:0.1"}, tasks=[...])

Importing this module registers the model with lm-eval (``register_model("policyzoo")``), and the
package declares it under lm-eval's ``lm_eval.models`` entry point group, which lm-eval versions
with plugin discovery read. lm-eval 0.4.x's own ``lm_eval`` command knows only the models of its
source tree, so its command line is `main` here: ``policyzoo-lm-eval`` (or
``python -m policyzoo.integrations.lm_eval``) takes ``lm_eval``'s arguments and runs RULER offline.

How each request type is computed (docs/lm-eval.md has the details):

- ``generate_until``: `Decoder.generate` (the prompt prefilled dense, every new token decoded
  through the policy), a batch of left-padded prompts at a time; greedy unless the request's
  ``do_sample`` says otherwise. A row stops at EOS, at ``max_gen_toks``, or at a token whose text
  holds one of the ``until`` strings; the text is then cut at the first ``until`` string.
- ``loglikelihood`` and ``loglikelihood_rolling``: teacher-forced sparse decoding, as in
  `policyzoo.eval`'s perplexity. All but the last context token are prefilled dense, then the last
  context token and the continuation are fed one decode step at a time through the policy, so each
  continuation token is scored from a policy step (one step per token: a long rolling window costs
  a step per token). A one-token context (an empty context becomes the EOS token, as in lm-eval) is
  prefilled and scores the first continuation token densely.

Inputs longer than ``max_length`` (default: the model's ``max_position_embeddings``) are cut from
the left, as lm-eval's ``hf`` model does: a generation prompt to ``max_length - max_gen_toks``
tokens, a scored sequence to its last ``max_length + 1`` tokens. A continuation longer than
``max_length`` is an error.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Iterable, Sequence

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm.auto import tqdm

from .. import assets
from .._compat import max_positions
from ..decoder import Decoder
from ..kv import KVSelector
from ..proj import ProjectionSparsifier
from ..spec import parse_kv, parse_proj

log = logging.getLogger(__name__)

MODEL_NAME = "policyzoo"
# Sampling settings `Decoder.generate` takes; any other generation kwarg is refused by name.
_GEN_KWARGS = ("do_sample", "temperature", "top_p")
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip
_ARGS = ("pretrained", "kv", "proj", "compile", "device", "dtype", "batch_size", "max_length", "max_gen_toks", "tokenizer")


@register_model(MODEL_NAME)
class PolicyzooLM(TemplateLM):
    """A causal LM decoded by `policyzoo.Decoder` for lm-eval.

    Args (lm-eval's ``--model_args``):
        pretrained: ``"smollm2-135m"`` (the embedded model), a Hub name or a local path, loaded by
            `policyzoo.assets.load_model`; or a model object (then ``tokenizer`` is required).
        kv: a KV policy spec (``"quest:0.1"``, ``"window:sinks=4,window=256"``; `policyzoo.spec`), a
            `KVSelector`, or None / ``"dense"`` for dense attention. A spec with several parameters
            is quoted on the command line: ``kv="quest:0.1,bound=sketch"``.
        proj: a projection sparsifier spec (``"topk:0.5"``), a `ProjectionSparsifier`, or None.
        compile: compile the decode step (`Decoder(compile=True)`).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...; default CUDA when there is one. A CUDA device
            asked for on a machine without one (lm-eval's command line asks for ``cuda:0`` by
            default) falls back to the CPU with a warning.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` (or a `torch.dtype`); default: as loaded.
        batch_size: requests decoded together (left-padded), an int >= 1.
        max_length: the longest sequence handled, default ``max_position_embeddings``.
        max_gen_toks: new tokens per generation when the task does not say, default 256.
        tokenizer: a tokenizer name or path (`policyzoo.assets.load_tokenizer`) or object; default
            the model's.
    """

    def __init__(
        self,
        pretrained: Any = assets.DEFAULT_MODEL,
        kv: str | KVSelector | None = None,
        proj: str | ProjectionSparsifier | None = None,
        compile: bool = False,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int | str = 1,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        tokenizer: Any = None,
        max_batch_size: int | None = None,  # lm-eval passes it with batch_size; unused (no auto batch size)
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise TypeError(_unknown_message(unknown))
        kv_policy = _kv_arg(kv)
        proj_policy = _proj_arg(proj)
        if not isinstance(compile, bool):
            raise TypeError(f"policyzoo model arg compile must be true or false, got {compile!r}")
        torch_dtype = _dtype_arg(dtype)
        self._device = _device_arg(device)
        self._batch_size = _count_arg(batch_size, "batch_size", minimum=1, auto_hint=True)
        self._max_gen_toks = _count_arg(max_gen_toks, "max_gen_toks", minimum=1)
        if max_length is not None:
            max_length = _count_arg(max_length, "max_length", minimum=2)

        model, tok = _load(pretrained, tokenizer, torch_dtype)
        model.to(self._device)
        if torch_dtype is not None:
            model.to(torch_dtype)
        self.tokenizer = tok
        self.pretrained = pretrained if isinstance(pretrained, str) else type(pretrained).__name__
        limit = max_positions(model)
        if limit is not None and max_length is not None and max_length > limit:
            raise ValueError(f"policyzoo model arg max_length={max_length} exceeds the model's max_position_embeddings ({limit})")
        # lm-eval's default where the config says nothing: 2048
        self._max_length = max_length if max_length is not None else limit if limit is not None else 2048
        self.kv_spec = kv if isinstance(kv, str) or kv is None else repr(kv)
        self.proj_spec = proj if isinstance(proj, str) or proj is None else repr(proj)
        self.decoder = Decoder(model, kv=kv_policy, proj=proj_policy, compile=compile)
        self._stop_ids: dict[tuple[str, ...], list[int]] = {}  # per set of stop strings: the tokens that end a row
        self._vocab_text: list[str] | None = None

    # ----------------------------------------------------------------------- lm-eval's interface
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return int(eos) if eos is not None else int(_model_eos(self.decoder.model)[0])

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", str(self.pretrained)).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``; the tokenizer's special tokens unless ``add_special_tokens`` says
        otherwise, or the string already starts with the BOS text."""
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            options = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **options)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )  # fmt: skip

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in its results' ``config``: the model and the policy actually used."""
        from .. import __version__

        model = self.decoder.model
        return {
            "policyzoo_version": __version__,
            "pretrained": self.pretrained,
            "kv": self.kv_spec or "dense",
            "kv_policy": type(self.decoder.kv).__name__ if self.decoder.kv is not None else None,
            "proj": self.proj_spec or "none",
            "proj_sparsifier": type(self.decoder.proj).__name__ if self.decoder.proj is not None else None,
            "model_num_parameters": sum(p.numel() for p in model.parameters()),
            "model_dtype": str(next(model.parameters()).dtype),
            "max_length": self.max_length,
        }

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """``(sum of log-probabilities, greedy?)`` of each continuation, by teacher-forced decoding."""
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("loglikelihood: a request has an empty continuation (nothing to score)")
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"loglikelihood: a continuation of {len(continuation)} tokens is longer than max_length ({self.max_length})"
                )
        # Longest first, as lm-eval's models do: similar lengths share a batch (little padding).
        collator = Collator(requests, sort_fn=lambda r: (-len(r[1]) - len(r[2]), tuple(r[1] + r[2])))
        results: list[tuple[float, bool]] = []
        bar = tqdm(total=len(requests), desc="policyzoo loglikelihood", disable=disable_tqdm or self.rank != 0)
        for chunk in collator.get_batched(n=self.batch_size):
            scores = self._score([(r[1], r[2]) for r in chunk])
            for request, score in zip(chunk, scores):
                if request[0] is not None:  # rolling windows have no request text to cache under
                    self.cache_hook.add_partial("loglikelihood", request[0], score)
            results.extend(scores)
            bar.update(len(chunk))
        bar.close()
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text: lm-eval's disjoint windows of ``max_length`` tokens
        (each conditioned on the token before it; the first on the EOS token), scored as
        `loglikelihood` scores a continuation and summed."""
        windows: list[tuple[Any, list[int], list[int]]] = []
        counts = []
        for (text,) in [r.args for r in requests]:
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1,
            )  # fmt: skip
            pairs = [lm_utils.make_disjoint_window(w) for w in rolling]
            windows.extend((None, context, continuation) for context, continuation in pairs)
            counts.append(len(pairs))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, at = [], 0
        for request, n in zip(requests, counts):
            total = sum(s for s, _ in scores[at : at + n])
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            totals.append(total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled) generation with `Decoder.generate`, cut at the ``until`` strings."""
        collator = Collator(
            [r.args for r in requests], sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
            group_by="gen_kwargs", group_fn=lambda a: a[1],
        )  # fmt: skip
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results: list[str] = []
        bar = tqdm(total=len(requests), desc="policyzoo generate_until", disable=disable_tqdm or self.rank != 0)
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            texts = self._generate(list(contexts), all_kwargs[0], eos_text)
            for args, text in zip(chunk, texts):
                self.cache_hook.add_partial("generate_until", args, text)
            results.extend(texts)
            bar.update(len(chunk))
        bar.close()
        return collator.get_original(results)

    # ---------------------------------------------------------------------------------- scoring
    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Score a batch of ``(context ids, continuation ids)`` through one sequence batch.

        Row ``i``'s sequence is its last ``max_length + 1`` tokens; its first ``p`` tokens (all of
        the context but its last token, or the one-token context itself) are prefilled, left-padded,
        and the rest but the last token fed one step at a time. Position ``k`` is predicted by the
        prefill's last logits when ``k == p``, else by the step that fed token ``k - 1``.
        """
        rows = []
        for context, continuation in pairs:
            full = (context + continuation)[-(self.max_length + 1) :]
            n_context = len(full) - len(continuation)  # >= 1: the continuation is at most max_length
            rows.append((full, n_context, max(n_context - 1, 1)))
        width = max(p for _, _, p in rows)
        steps = max(len(full) - 1 - p for full, _, p in rows)
        pad = self.eot_token_id
        prompt = torch.tensor([[pad] * (width - p) + full[:p] for full, _, p in rows], device=self.device)
        mask = torch.tensor([[0] * (width - p) + [1] * p for _, _, p in rows], device=self.device)
        session = self.decoder.session
        logits = session.prefill(prompt, mask, capacity=width + steps)[:, -1]
        totals = [0.0] * len(rows)
        greedy = [True] * len(rows)
        for j in range(steps + 1):
            # ``logits`` predict position p + j of each row: score the rows where that is a continuation token.
            where = [i for i, (full, n_context, p) in enumerate(rows) if n_context <= p + j < len(full)]
            if where:
                targets = torch.tensor([rows[i][0][rows[i][2] + j] for i in where], device=self.device)
                lp = torch.log_softmax(logits[where].float(), dim=-1)
                picked = lp.gather(1, targets[:, None])[:, 0].tolist()
                hits = (lp.argmax(-1) == targets).tolist()
                for i, v, h in zip(where, picked, hits):
                    totals[i] += v
                    greedy[i] = greedy[i] and bool(h)
            if j == steps:
                break
            fed = [full[p + j] if p + j < len(full) - 1 else pad for full, _, p in rows]  # finished rows feed padding
            logits = session.step(torch.tensor(fed, device=self.device))
        return list(zip(totals, greedy))

    # ------------------------------------------------------------------------------- generation
    def _generate(self, contexts: list[str], gen_kwargs: dict, eos_text: str) -> list[str]:
        if not isinstance(gen_kwargs, dict):
            raise TypeError(f"generate_until: generation kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        max_gen = _count_arg(kwargs.pop("max_gen_toks"), "max_gen_toks", minimum=1)
        settings = {k: kwargs.pop(k) for k in _GEN_KWARGS if k in kwargs}
        if kwargs:
            raise ValueError(
                f"generate_until: generation kwargs {sorted(kwargs)} are not supported by the policyzoo model "
                f"(it takes until, max_gen_toks and {', '.join(_GEN_KWARGS)})"
            )
        do_sample = bool(settings.get("do_sample", False)) and float(settings.get("temperature", 1.0) or 0.0) > 0
        room = self.max_length - max_gen
        if room < 1:
            raise ValueError(f"generate_until: max_gen_toks ({max_gen}) must be below max_length ({self.max_length})")
        encoded = []
        for context in contexts:
            ids = self.tok_encode(context) or [self.prefix_token_id]
            if len(ids) > room:
                log.warning("generate_until: a prompt of %d tokens is cut to its last %d (max_length - max_gen_toks)", len(ids), room)
            encoded.append(ids[-room:])
        width = max(len(ids) for ids in encoded)
        pad = self.eot_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=self.device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=self.device)
        stops = self._stop_token_ids(until)
        out = self.decoder.generate(
            input_ids, max_new_tokens=max_gen, attention_mask=mask, do_sample=do_sample,
            temperature=float(settings["temperature"]) if do_sample else 1.0,
            top_p=float(settings.get("top_p", 1.0)) if do_sample else 1.0,
            eos_token_id=stops, pad_token_id=pad,
        )  # fmt: skip
        stop_set = set(stops)
        texts = []
        for row in out[:, width:].tolist():
            end = next((k + 1 for k, t in enumerate(row) if t in stop_set), len(row))  # finished rows are padded after
            texts.append(postprocess_generated_text(self.tok_decode(row[:end]), until, None))
        return texts

    def _stop_token_ids(self, until: Iterable[str]) -> list[int]:
        """The model's EOS ids and every token whose text holds one of the ``until`` strings.

        Generation stops at such a token: the text up to it holds a stop string, so whatever
        follows is cut anyway. A stop string that only forms across tokens ends the text when lm-eval
        cuts it, after ``max_gen_toks`` steps or EOS."""
        key = tuple(sorted({s for s in until if s}))
        if key not in self._stop_ids:
            if self._vocab_text is None:
                vocab = min(len(self.tokenizer), self.decoder.session.vocab_size)
                self._vocab_text = self.tokenizer.batch_decode([[i] for i in range(vocab)], skip_special_tokens=False)
            ids = set(_model_eos(self.decoder.model)) | {self.eot_token_id}
            ids |= {i for i, text in enumerate(self._vocab_text) if any(s in text for s in key)}
            self._stop_ids[key] = sorted(i for i in ids if 0 <= i < self.decoder.session.vocab_size)
        return self._stop_ids[key]


# ------------------------------------------------------------------------------- argument checks
def _unknown_message(unknown: dict[str, Any]) -> str:
    names = ", ".join(sorted(unknown))
    message = f"policyzoo model: unknown model arg(s) {names}; accepted: {', '.join(_ARGS)}"
    # lm-eval's plain "k=v,k=v" parsing splits a spec with several parameters at its commas.
    return message + (
        '. A kv or proj spec with several parameters must be quoted in --model_args '
        '(kv="quest:0.1,bound=sketch") or passed in a dict of model_args'
    )


def _kv_arg(kv: Any) -> KVSelector | None:
    if kv is None or isinstance(kv, KVSelector):
        return kv
    if not isinstance(kv, str):
        raise TypeError(f"policyzoo model arg kv must be a KV policy spec such as 'quest:0.1', a KVSelector or None, got {kv!r}")
    try:
        return parse_kv(kv)
    except ValueError as e:
        raise ValueError(f"policyzoo model arg kv={kv!r}: {e}") from None


def _proj_arg(proj: Any) -> ProjectionSparsifier | None:
    if proj is None or isinstance(proj, ProjectionSparsifier):
        return proj
    if not isinstance(proj, str):
        raise TypeError(f"policyzoo model arg proj must be a projection spec such as 'topk:0.5', a ProjectionSparsifier or None, got {proj!r}")
    try:
        return parse_proj(proj)
    except ValueError as e:
        raise ValueError(f"policyzoo model arg proj={proj!r}: {e}") from None


def _dtype_arg(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() == "auto":
        return None
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"policyzoo model arg dtype must be one of auto, float32, bfloat16, float16, got {dtype!r}")


def _device_arg(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"policyzoo model arg device must be a device name such as 'cpu' or 'cuda:0', got {device!r}")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"policyzoo model arg device={device!r} is not a device: {e}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        log.warning("policyzoo model arg device=%s, but CUDA is not available: decoding on the CPU", device)
        return torch.device("cpu")
    return resolved


def _count_arg(value: Any, name: str, minimum: int, auto_hint: bool = False) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        hint = " (an automatic batch size is not supported)" if auto_hint and isinstance(value, str) else ""
        raise ValueError(f"policyzoo model arg {name} must be an int >= {minimum}, got {value!r}{hint}")
    return value


def _load(pretrained: Any, tokenizer: Any, dtype: torch.dtype | None) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` from the ``pretrained`` and ``tokenizer`` model args."""
    tok = tokenizer
    if isinstance(tokenizer, str):
        tok = assets.load_tokenizer(tokenizer)
    elif tokenizer is not None and not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"policyzoo model arg tokenizer must be a tokenizer name, a path or a tokenizer, got {tokenizer!r}")
    if isinstance(pretrained, torch.nn.Module):
        if tok is None:
            raise ValueError("policyzoo model arg tokenizer is required when pretrained is a model object")
        return pretrained.eval(), tok
    if not isinstance(pretrained, str) or not pretrained:
        raise TypeError(f"policyzoo model arg pretrained must be a model name, a path or a model, got {pretrained!r}")
    # The embedded model's float32 copy is cached (a second to load); any dtype is applied after.
    options = {"dtype": dtype} if dtype is not None and pretrained != assets.DEFAULT_MODEL else {}
    try:
        model, loaded_tok = assets.load_model(pretrained, **options)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"policyzoo model arg pretrained={pretrained!r}: {e}") from e
    return model, tok if tok is not None else loaded_tok


def _model_eos(model: torch.nn.Module) -> list[int]:
    """The EOS ids in the model's generation config (or config); may be several (Llama 3)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


# ------------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> None:
    """``policyzoo-lm-eval``: lm-eval's command line with the ``policyzoo`` model registered.

    It takes ``lm_eval``'s arguments. For ``--model policyzoo`` it runs inside
    `policyzoo.integrations.ruler.offline_ruler` (RULER's sentence model and essays without a
    network) and, when ``pretrained`` is the embedded model and neither the model args nor
    ``--metadata`` name a tokenizer, adds the embedded tokenizer's directory as the ``tokenizer``
    metadata RULER sizes its samples with.
    """
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from .ruler import offline_ruler

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    setup_logging()
    cli = HarnessCLI()
    args = cli.parse_args()
    if getattr(args, "command", None) != "run" or getattr(args, "model", None) != MODEL_NAME:
        cli.execute(args)
        return
    model_args = args.model_args or {}
    metadata = dict(args.metadata or {})
    with offline_ruler() as offline:
        if model_args.get("pretrained", assets.DEFAULT_MODEL) == assets.DEFAULT_MODEL and "tokenizer" not in model_args | metadata:
            args.metadata = {**offline, **metadata}
        cli.execute(args)


if __name__ == "__main__":
    main()
