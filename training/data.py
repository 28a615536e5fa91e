"""Data pipelines for training/: sklearn digits for the demo ViT, and the shared grain epoch iterator.

load_digits ships with scikit-learn (no download), so the demo trains anywhere, including CI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grain
import numpy as np
from sklearn.datasets import load_digits

from jaxserve.datasets import digits_split, upsample_digits


@dataclass(frozen=True)
class DigitsSplit:
    images: np.ndarray  # [N, H, W, C] float32, normalised
    labels: np.ndarray  # [N] int32

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:  # the grain MapDataset source protocol
        return {"image": self.images[index], "label": self.labels[index]}


@dataclass(frozen=True)
class Digits:
    train: DigitsSplit
    test: DigitsSplit
    pixel_mean: float  # serving applies (x - mean) / std to [0, 1] images: the same normalisation
    pixel_std: float


def prepare_digits(image_shape: tuple[int, int, int], test_fraction: float = 0.2, split_seed: int = 0) -> Digits:
    """Digits upsampled with jaxserve.datasets.upsample_digits (the one function serving uses too),
    normalised with training-set statistics, split stratified with a fixed seed so every run and every
    consumer (profiler, tests) sees the same held-out images."""
    digits = load_digits()
    images = upsample_digits(digits.images, image_shape)  # [N, H, W, C] in [0, 1]
    labels = digits.target.astype(np.int32)
    train, test = digits_split(test_fraction, split_seed)
    x_train, x_test, y_train, y_test = images[train], images[test], labels[train], labels[test]
    mean, std = float(x_train.mean()), float(x_train.std())
    normalise = lambda x: ((x - mean) / std).astype(np.float32)
    return Digits(DigitsSplit(normalise(x_train), y_train), DigitsSplit(normalise(x_test), y_test), mean, std)


def train_batches(source: Sequence, batch_size: int, seed: int, epoch: int) -> grain.MapDataset:
    """One epoch of shuffled full batches from any grain source (len + getitem of dicts).

    drop_remainder keeps one static batch shape, so the train step compiles once.
    """
    return (
        grain.MapDataset.source(source)
        .shuffle(seed=seed * 100_003 + epoch)  # a different, reproducible order every epoch
        .batch(batch_size, drop_remainder=True)
    )
