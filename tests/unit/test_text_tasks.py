"""The cascade's text tasks: fixed, seeded, stratified train/val/test splits of real corpora.

Contracts checked: the three splits of a task are disjoint (as index sets and as texts) and cover the
deduplicated corpus; validation and test hold the documented sizes (>= 2,000 each); the same call
gives the same split; every split keeps each class's share of the corpus; the capped training subset
is fixed and stratified too.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.datasets import TEXT_TASKS, text_task_corpus, text_task_indices, text_task_parts, text_task_split

CORPUS_TASKS = [t for t in TEXT_TASKS if not TEXT_TASKS[t].parts]
SIZES = {"tweets": (32_243, 2_500, 2_500), "reviews": (8_752, 2_000, 2_000), "topic": (3_595, 2_000, 2_000)}


@pytest.mark.parametrize("task", CORPUS_TASKS)
def test_splits_are_disjoint_cover_the_corpus_and_have_the_documented_sizes(task):
    texts, labels = text_task_corpus(task)
    assert len(set(texts)) == len(texts)  # duplicates merged before splitting
    idx = text_task_indices(task)
    assert tuple(len(idx[s]) for s in ("train", "val", "test")) == SIZES[task]
    assert min(len(idx["val"]), len(idx["test"])) >= 2_000
    union = np.concatenate([idx["train"], idx["val"], idx["test"]])
    assert len(np.unique(union)) == len(union) == len(texts)
    split_texts = {s: set(text_task_split(task, s)[0]) for s in ("train", "val", "test")}
    assert not split_texts["train"] & split_texts["val"]
    assert not split_texts["train"] & split_texts["test"]
    assert not split_texts["val"] & split_texts["test"]


@pytest.mark.parametrize("task", CORPUS_TASKS)
def test_splits_are_stratified(task):
    _, labels = text_task_corpus(task)
    classes = len(TEXT_TASKS[task].labels)
    assert labels.min() >= 0 and labels.max() == classes - 1
    overall = np.bincount(labels, minlength=classes) / len(labels)
    for split in ("train", "val", "test"):
        _, y, names = text_task_split(task, split)
        assert names == TEXT_TASKS[task].labels
        share = np.bincount(y, minlength=classes) / len(y)
        assert np.abs(share - overall).max() < 0.005, (split, share, overall)


def test_splits_are_seeded_and_deterministic():
    text_task_indices.cache_clear()  # recompute, not the memoised arrays
    first = text_task_split("reviews", "test")
    text_task_indices.cache_clear()
    again = text_task_split("reviews", "test")
    assert first[0] == again[0] and np.array_equal(first[1], again[1])
    other_seed = text_task_split("reviews", "test", seed=1)
    assert set(other_seed[0]) != set(first[0])


def test_capped_training_subset_is_fixed_stratified_and_inside_train():
    texts, y, _ = text_task_split("tweets", "train", max_items=10_000)
    again, _, _ = text_task_split("tweets", "train", max_items=10_000)
    assert len(texts) == 10_000 and texts == again
    full, y_full, _ = text_task_split("tweets", "train")
    assert set(texts) <= set(full)
    assert np.abs(np.bincount(y, minlength=3) / len(y) - np.bincount(y_full, minlength=3) / len(y_full)).max() < 0.002


def test_labels_follow_the_sources():
    texts, labels = text_task_corpus("reviews")
    assert TEXT_TASKS["reviews"].labels == ("negative", "positive")
    assert np.bincount(labels).tolist() == [5_384, 7_368]  # rotten, fresh (unique snippets)
    texts, labels = text_task_corpus("topic")
    assert np.bincount(labels).tolist() == [2_285, 366, 3_915, 51, 247, 278, 141, 312]  # R8, unique texts


def test_the_sentiment_task_is_its_parts_splits_with_labels_mapped_by_name():
    spec = TEXT_TASKS["sentiment"]
    assert spec.labels == ("negative", "neutral", "positive") and spec.parts == ("tweets", "reviews", "plots")
    seen = {}
    for split in ("train", "val", "test"):
        texts, labels, names = text_task_split("sentiment", split)
        parts = text_task_parts("sentiment", split)
        assert [p for p, _, _ in parts] == ["tweets", "reviews", "plots"]
        assert texts == [t for _, ts, _ in parts for t in ts]
        tweets, reviews, plots = parts
        assert tweets[2].tolist() == text_task_split("tweets", split)[1].tolist()  # same order as labelled
        review_y = text_task_split("reviews", split)[1]
        assert reviews[2].tolist() == [names.index(("negative", "positive")[y]) for y in review_y]
        assert set(plots[2].tolist()) <= {names.index("neutral")}
        seen[split] = set(texts)
    assert len(text_task_split("sentiment", "val")[0]) == TEXT_TASKS["sentiment"].val_size
    assert len(text_task_split("sentiment", "test")[0]) == TEXT_TASKS["sentiment"].test_size
    assert not text_task_parts("sentiment", "test")[2][1]  # the plot sentences: train and validation only
    assert not seen["train"] & seen["val"] and not seen["train"] & seen["test"] and not seen["val"] & seen["test"]
    capped = text_task_parts("sentiment", "train", {"tweets": 2_000, "reviews": 2_000})
    assert [len(t) for _, t, _ in capped[:2]] == [2_000, 2_000]
    assert capped[0][1] == text_task_split("tweets", "train", max_items=2_000)[0]  # the tweets heads' subset
    with pytest.raises(KeyError, match="composite"):
        text_task_corpus("sentiment")
