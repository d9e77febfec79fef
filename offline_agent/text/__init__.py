"""Text to vectors: state text, text encoders, the embedding cache. Below `learn/`, which it never imports.

The offline learner scores (state, action) pairs over frozen text embeddings, so every state and action
text of a dataset is embedded once and kept. This package holds the pieces that make that reproducible:

- `states.py`: `render_state`, the one function that turns (task, recent turns, observation) into state
  text, over logged datasets and at decision time alike; `dataset_texts`; the observation view;
- `encoder.py`: `TextEncoder`, a transformers encoder loaded from a local folder (mean pooling + L2 norm,
  the sentence-transformers recipe of all-MiniLM-L6-v2), whose `id` names the model and its settings;
- `tuning.py`: what the encoder needs to load fine-tuned top layers (`learn/encoder_tuning.py` trains them);
- `cache.py`: `EmbeddingCache`, Parquet part files under `ROOT/<encoder id>/` keyed by the sha256 of each
  text, and `EmbeddingMemo`, the bounded in-memory memo rollouts embed through;
- `ray.py`: the cache's uncached texts encoded by a pool of Ray actors (`--backend ray`).
"""
