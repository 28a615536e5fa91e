"""Frozen text-encoder features for head training: any ``registry.TEXT_MODELS`` encoder, cached on disk.

Every head trainer (the tweet-sentiment head, the cascade heads) embeds its texts here, once per
(model, texts): :func:`cached_embeddings` returns the L2-normalised mean-pooled ``embedding`` output
of the model (``jaxserve.models.bert.pool``, what the server's TaskHeads read), computed by one
jitted call per length bucket and kept as ``.npy`` under :func:`embeddings_dir` (outside the
repository), keyed by the model name, :data:`MAX_TOKENS`, the embedding format version and a
sha256 of the texts. The key does not hash the weights: a model whose conversion changes must be
given a new name, or its cache files deleted.

Long texts are truncated to :data:`MAX_TOKENS` = 256 tokens ([CLS]/[SEP] or the model's own
specials included), sentence-transformers' max_seq_length for all-MiniLM-L6-v2; only Reuters
articles reach it. The cut keeps the head of the text (``TextTokenizer.truncate``).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxserve.sched.base import ShapeGrid

MAX_TOKENS = 256
EMBED_BATCH = 32
EMBED_GRID = ShapeGrid(batch_sizes=(EMBED_BATCH,), seq_buckets=(16, 32, 64, 128, 256))
EMBED_FORMAT = 1  # bump when what is computed changes (pooling, truncation rule): old caches are not reused


def embeddings_dir() -> Path:
    """``$JAXSERVE_EMBEDDINGS_DIR``, else ``$XDG_CACHE_HOME/jaxserve/embeddings`` or
    ``~/.cache/jaxserve/embeddings``: never the repository."""
    explicit = os.environ.get("JAXSERVE_EMBEDDINGS_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxserve" / "embeddings"


def texts_digest(texts: Sequence[str]) -> str:
    """sha256 over the texts in order (NUL-separated UTF-8): equal iff the same texts in the same order."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8") + b"\0")
    return h.hexdigest()


def embedding_cache_path(model: str, texts: Sequence[str], cache_dir: Path | None = None) -> Path:
    """Where :func:`cached_embeddings` keeps the features of ``texts`` under ``model``."""
    key = f"{model}-t{MAX_TOKENS}-v{EMBED_FORMAT}-{texts_digest(texts)[:24]}"
    return Path(cache_dir or embeddings_dir()) / model / f"{key}.npy"


class TextEmbedder:
    """One text encoder, loaded on first use (``registry.load_text_model``), embedding text lists.

    ``embed(texts)`` -> float32 [N, hidden]: the texts are tokenized, truncated to ``max_tokens``,
    grouped by the bucket ``grid.cell_for`` assigns, and run ``grid.max_batch`` at a time through
    one jitted ``pool(model(ids, mask), mask)`` per bucket (the pure function the servables compile,
    ``make_encode_fn``; on the CPU it runs the same fused attention kernel). Padding rows and
    padded tokens are masked, so a text's features do not depend on its batch-mates.
    """

    def __init__(self, model: str, grid: ShapeGrid = EMBED_GRID, max_tokens: int = MAX_TOKENS):
        self.model_name = model
        self.grid = grid
        self.max_tokens = min(max_tokens, grid.max_length)
        self._loaded = None
        self.seconds = 0.0  # wall time spent computing embeddings (not loading, not cache reads)
        self.computed = 0  # texts embedded (cache misses)

    def _load(self):
        if self._loaded is None:
            import jax
            from flax import nnx

            from jaxserve.models.bert import make_encode_fn
            from jaxserve.models.tokenizer import TextTokenizer
            from jaxserve.registry import load_text_model

            cfg, model, tokenizer_json = load_text_model(self.model_name)
            graphdef, state = nnx.split(model)
            encode = jax.jit(make_encode_fn(graphdef))
            self._loaded = (cfg, state, encode, TextTokenizer(tokenizer_json))
        return self._loaded

    def embed(self, texts: Sequence[str], progress: bool = True, desc: str | None = None) -> tuple[np.ndarray, int]:
        """(embeddings float32 [N, hidden], number of texts truncated)."""
        from jaxserve.polymorph import pad_token_batch

        cfg, state, encode, tokenizer = self._load()
        t0 = time.perf_counter()
        raw = tokenizer.encode(list(texts))
        truncated = sum(len(ids) > self.max_tokens for ids in raw)
        token_lists = [tokenizer.truncate(ids, self.max_tokens) for ids in raw]
        by_bucket: dict[int, list[int]] = defaultdict(list)
        for i in np.argsort([len(ids) for ids in token_lists], kind="stable"):
            by_bucket[self.grid.cell_for(1, len(token_lists[i])).seq].append(int(i))
        chunks = []
        for bucket in sorted(by_bucket):
            rows = by_bucket[bucket]
            for start in range(0, len(rows), self.grid.max_batch):
                part = rows[start: start + self.grid.max_batch]
                chunks.append((self.grid.cell_for(self.grid.max_batch, len(token_lists[part[-1]])), part))
        out = np.zeros((len(token_lists), cfg.hidden_size), dtype=np.float32)
        for cell, part in tqdm(chunks, desc=desc or f"embedding {self.model_name}", unit="batch",
                               disable=not progress, mininterval=5.0):
            ids, mask = pad_token_batch([token_lists[i] for i in part], cell, pad_id=tokenizer.pad_id)
            out[part] = np.asarray(encode(state, ids, mask)["embedding"])[: len(part)]
        self.seconds += time.perf_counter() - t0
        self.computed += len(token_lists)
        return out, truncated


def cached_embeddings(embedder: TextEmbedder, texts: Sequence[str], cache_dir: Path | None = None,
                      progress: bool = True, desc: str | None = None) -> tuple[np.ndarray, Path, bool]:
    """(embeddings [N, hidden] float32, cache path, whether it was a cache hit). Computed once per
    (model, texts) and written atomically, so concurrent runs never read half a file."""
    path = embedding_cache_path(embedder.model_name, texts, cache_dir)
    if path.exists():
        features = np.load(path)
        if features.shape[0] == len(texts):
            return features, path, True
    features, _ = embedder.embed(texts, progress=progress, desc=desc)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, features)
    tmp.replace(path)
    return features, path, False
