"""Fine-tuning of `policyzoo.kv.Forecast`'s heads against the next layer's attention over blocks
(``python -m recipes.forecast.train``; see ``README.md`` beside this file)."""
