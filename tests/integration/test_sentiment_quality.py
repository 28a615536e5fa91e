"""The shipped default ``sentiment`` head (minilm-l6) answers clearly polar or neutral everyday sentences.

The hold-out sentences (tests/fixtures/sentiment_holdout.json) were written before the head's recipe
was chosen and are never used for training or selection (the recipe was picked on
sentiment_dev.json; training/train_cascade_heads.py --default-sentiment). The head is applied, as
the server applies it (``TaskHead.probabilities``), to MiniLM-L6's pooled embedding of each sentence
computed by the real model (the jitted encode function the servables compile).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxserve.registry import ASSETS
from jaxserve.runtime import TaskHead

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def sentences(name):
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    return [x["text"] for x in data["items"]], [x["label"] for x in data["items"]]


@pytest.fixture(scope="module")
def head_and_embedder():
    from training.text_embeddings import TextEmbedder

    head = TaskHead.load("sentiment", ASSETS / "heads" / "minilm-l6" / "sentiment.npz")
    return head, TextEmbedder("minilm-l6")


def test_holdout_set_is_balanced_enough_to_mean_something():
    texts, labels = sentences("sentiment_holdout")
    assert len(texts) >= 40 and len(set(texts)) == len(texts)
    counts = {label: labels.count(label) for label in set(labels)}
    assert set(counts) == {"negative", "neutral", "positive"} and min(counts.values()) >= 10
    dev, _ = sentences("sentiment_dev")
    assert not set(dev) & set(texts)


def test_default_sentiment_head_gets_90_percent_of_holdout_sentences(head_and_embedder):
    head, embedder = head_and_embedder
    texts, labels = sentences("sentiment_holdout")
    assert head.labels == ("negative", "neutral", "positive")
    features, _ = embedder.embed(texts, progress=False)
    predicted = [head.labels[i] for i in head.probabilities(features).argmax(-1)]
    wrong = [(t, want, got) for t, want, got in zip(texts, labels, predicted) if want != got]
    accuracy = 1.0 - len(wrong) / len(texts)
    assert accuracy >= 0.90, f"{accuracy:.3f} on {len(texts)} hold-out sentences; wrong: {wrong}"


def test_default_sentiment_head_is_calibrated_and_documented(head_and_embedder):
    head, _ = head_and_embedder
    meta = json.loads((ASSETS / "heads" / "minilm-l6" / "sentiment.json").read_text())
    assert head.temperature == pytest.approx(meta["temperature"], rel=1e-4)
    assert meta["label_source"] and meta["recipe_selected_on"].startswith("accuracy on tests/fixtures/sentiment_dev")
    assert np.isfinite(head.weight).all()
