"""The elpv solar-cell task (benchmark-only): its loader and its DINOv2 split, on small directories
laid out like ``elpv_dataset/data`` of ``elpv-dataset==1.0.0.post1`` (``labels.csv`` + PNGs written
here with PIL); the real package is never needed.

Contracts checked: labels.csv is read whatever its delimiter (the package's runs of spaces, commas,
tabs; a header row skipped); the four probability levels map to labels 0..3 in increasing order;
images decode to float32 [N, 300, 300] in [0, 1], exactly the PNG's bytes / 255, in the rows asked
for; a missing root, image or package and a malformed row each give an error naming what is wrong;
the split is seeded, disjoint and stratified, and a per-class size beyond the smallest class is
refused naming the limit.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from PIL import Image

from jaxserve import datasets
from jaxserve.datasets import (DINOV2_BENCH_TASKS, DINOV2_TASKS, ELPV_LABELS, ELPV_PIP, dinov2_task_split,
                               elpv_index, load_elpv)
from jaxserve.prompts import BENCHMARK_ONLY_LICENCES
from jaxserve.registry import MissingAsset

# probabilities as the package writes them (float repr of k/3)
PROBABILITY = {0: "0.0", 1: "0.3333333333333333", 2: "0.6666666666666666", 3: "1.0"}


def write_elpv(root, levels, delimiter="  ", header=False, mode="L", size=300):
    """A data directory like the package's: image i is constant at gray value 10 + 7 i (so an image
    names its row), with a horizontal ramp in row 0 (so decoding is checked beyond one value)."""
    (root / "images").mkdir(parents=True)
    lines = [delimiter.join(["path", "probability", "type"])] if header else []
    for i, level in enumerate(levels):
        pixels = np.full((size, size), 10 + 7 * i, np.uint8)
        pixels[0] = np.arange(size) % 256
        image = Image.fromarray(pixels, mode="L")
        (image.convert(mode) if mode != "L" else image).save(root / "images" / f"cell{i + 1:04d}.png")
        lines.append(delimiter.join([f"images/cell{i + 1:04d}.png", PROBABILITY[level], "mono" if i % 2 else "poly"]))
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


def row_of(image01: np.ndarray) -> int:
    """The row an image (resized or not, any channel) came from: its constant value (away from row 0)."""
    return (int(round(float(np.asarray(image01)[-1, -1].ravel()[0]) * 255)) - 10) // 7


# ---------------------------------------------------------------- loader

def test_reads_the_package_layout_labels_and_pixels(tmp_path):
    levels = [3, 3, 0, 1, 2, 0]
    root = write_elpv(tmp_path / "data", levels)
    images, labels = load_elpv(root)
    assert images.dtype == np.float32 and images.shape == (6, 300, 300)
    assert labels.dtype == np.int32 and labels.tolist() == levels
    for i, image in enumerate(images):
        expected = np.asarray(Image.open(root / "images" / f"cell{i + 1:04d}.png"), np.float32) / 255.0
        np.testing.assert_array_equal(image, expected)
        assert row_of(image) == i
    assert 0.0 <= images.min() and images.max() <= 1.0 and images[0, 0, 255] == 1.0
    paths, labels2, types = elpv_index(root)
    assert paths[0] == "images/cell0001.png" and types[:2] == ("poly", "mono")
    np.testing.assert_array_equal(labels2, levels)


def test_the_four_levels_are_in_increasing_order():
    assert ELPV_LABELS == ("p0", "p1/3", "p2/3", "p1")


@pytest.mark.parametrize("delimiter,header", [(",", True), ("\t", False), (";", True), (" ", False)])
def test_other_delimiters_and_a_header_read_the_same(tmp_path, delimiter, header):
    levels = [0, 1, 2, 3, 1]
    root = write_elpv(tmp_path / "data", levels, delimiter=delimiter, header=header)
    paths, labels, types = elpv_index(root)
    assert labels.tolist() == levels and len(paths) == 5 and set(types) == {"mono", "poly"}


def test_only_the_rows_asked_for_are_returned_in_that_order(tmp_path):
    root = write_elpv(tmp_path / "data", [0, 1, 2, 3])
    images, labels = load_elpv(root, indices=[3, 0])
    assert images.shape == (2, 300, 300) and labels.tolist() == [3, 0]
    assert [row_of(x) for x in images] == [3, 0]


def test_a_missing_root_names_labels_csv(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no labels\.csv in .*nowhere"):
        load_elpv(tmp_path / "nowhere")


def test_a_missing_image_is_named(tmp_path):
    root = write_elpv(tmp_path / "data", [0, 1])
    (root / "images" / "cell0002.png").unlink()
    with pytest.raises(FileNotFoundError, match="cell0002.png"):
        load_elpv(root)


def test_a_probability_off_the_four_levels_names_the_line(tmp_path):
    root = write_elpv(tmp_path / "data", [0, 1])
    (root / "labels.csv").write_text("images/cell0001.png 0.0 mono\nimages/cell0002.png 0.5 poly\n")
    with pytest.raises(ValueError, match=r"line 2: probability 0.5 is not one of 0, 1/3, 2/3, 1"):
        elpv_index(root)


def test_a_row_of_another_shape_names_the_line(tmp_path):
    root = write_elpv(tmp_path / "data", [0, 1])
    (root / "labels.csv").write_text("images/cell0001.png 0.0 mono\nimages/cell0002.png 1.0\n")
    with pytest.raises(ValueError, match="line 2: expected 3 fields"):
        elpv_index(root)


@pytest.mark.parametrize("mode,size", [("RGB", 300), ("L", 64)])
def test_an_image_not_300x300_gray_is_refused(tmp_path, mode, size):
    root = write_elpv(tmp_path / "data", [0, 1], mode=mode, size=size)
    with pytest.raises(ValueError, match=r"cell0001\.png is a .*expected 300x300 8-bit gray"):
        load_elpv(root)


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "elpv_dataset" else real(name, *a))
    with pytest.raises(MissingAsset, match=f"pip install --no-deps {ELPV_PIP}"):
        load_elpv()
    assert ELPV_PIP == "elpv-dataset==1.0.0.post1"


# ---------------------------------------------------------------- split

# class sizes 6, 5, 3, 4: the smallest class (p2/3) holds 3
LEVELS = [0, 1, 2, 3, 0, 1, 0, 3, 2, 1, 0, 3, 0, 1, 2, 3, 0, 1]


def split(root, part, **kw):
    return dinov2_task_split("elpv", part, 14, elpv_root=root, **kw)


def test_split_is_stratified_disjoint_seeded_and_preprocessed(tmp_path):
    root = write_elpv(tmp_path / "data", LEVELS)
    train, labels = split(root, "train", train_per_class=2, eval_per_class=1)
    held, _ = split(root, "heldout", train_per_class=2, eval_per_class=1)
    assert labels == ELPV_LABELS
    assert train.images.shape == (8, 14, 14, 3) and held.images.shape == (4, 14, 14, 3)
    assert train.images.dtype == np.float32
    assert np.bincount(train.labels, minlength=4).tolist() == [2, 2, 2, 2]
    assert np.bincount(held.labels, minlength=4).tolist() == [1, 1, 1, 1]
    train_rows = [row_of(x) for x in train.images]
    held_rows = [row_of(x) for x in held.images]
    assert not set(train_rows) & set(held_rows)
    assert [LEVELS[r] for r in train_rows] == train.labels.tolist()  # each image keeps its own label
    assert [LEVELS[r] for r in held_rows] == held.labels.tolist()
    again, _ = split(root, "train", train_per_class=2, eval_per_class=1)
    np.testing.assert_array_equal(again.images, train.images)
    other = [row_of(x) for x in split(root, "train", train_per_class=2, eval_per_class=1, seed=1)[0].images]
    assert sorted(other) != sorted(train_rows)


def test_per_class_sizes_beyond_the_smallest_class_are_refused_naming_it(tmp_path):
    root = write_elpv(tmp_path / "data", LEVELS)
    split(root, "heldout", train_per_class=2, eval_per_class=1)  # 3 per class: exactly what p2/3 holds
    with pytest.raises(ValueError, match=r"= 4 per class, but class 'p2/3' holds only 3: at most 3 per class"):
        split(root, "heldout", train_per_class=2, eval_per_class=2)
    with pytest.raises(ValueError, match="'p2/3' holds only 3"):
        split(root, "train", train_per_class=4, eval_per_class=1)


def test_the_split_refuses_bad_arguments(tmp_path):
    root = write_elpv(tmp_path / "data", LEVELS)
    with pytest.raises(ValueError, match="split must be"):
        split(root, "test")
    with pytest.raises(ValueError, match="elpv_root is for task 'elpv' only"):
        dinov2_task_split("animals", "train", 14, elpv_root=root)
    with pytest.raises(KeyError, match="benchmark-only"):
        dinov2_task_split("nosuch", "train", 14)


def test_benchmark_tasks_are_apart_from_the_served_ones_and_carry_a_licence():
    assert DINOV2_TASKS == ("mnist", "animals")
    assert DINOV2_BENCH_TASKS == ("elpv",)
    assert not set(DINOV2_BENCH_TASKS) & set(DINOV2_TASKS)
    for task in DINOV2_BENCH_TASKS:
        assert task in BENCHMARK_ONLY_LICENCES, f"{task} is benchmark-only: prompts.BENCHMARK_ONLY_LICENCES must name it"
    assert BENCHMARK_ONLY_LICENCES["elpv"] == "CC-BY-NC-SA-4.0"
    assert datasets.ELPV_SIZE == 300
