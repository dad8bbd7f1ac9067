"""Integrations of policyzoo with other tools, each an optional extra imported on demand.

- `policyzoo.integrations.lm_eval`: the ``policyzoo`` model of EleutherAI's lm-evaluation-harness
  (``pip install "policyzoo[lm-eval]"``; see ``docs/lm-eval.md``).
- `policyzoo.integrations.ruler`: what lm-eval's RULER tasks need to run without a network (the
  embedded tokenizer as a directory, a sentence splitter, the essay haystack).

Nothing is imported here, so ``import policyzoo`` never needs the extras.
"""
