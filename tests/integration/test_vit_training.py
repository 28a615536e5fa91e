"""Demo ViT training smoke test: grain data, optax steps, orbax checkpoint round trip (training/)."""

import json

import numpy as np

from jaxserve.models.vit import VIT_CONFIGS, load_vit_checkpoint
from jaxserve.datasets import prepare_digits
from training.train_vit_digits import evaluate, train


def test_digits_split_is_fixed_and_stratified():
    a, b = prepare_digits((16, 16, 3)), prepare_digits((16, 16, 3))
    assert (len(a.train), len(a.test)) == (1437, 360)
    assert a.train.images.shape[1:] == (16, 16, 3)
    np.testing.assert_array_equal(a.test.labels, b.test.labels)
    assert np.bincount(a.test.labels).min() >= 35  # stratified: every class ~36 times
    assert abs(float(a.train.images.mean())) < 1e-4 and 0 < a.pixel_mean < 1


def test_examples_are_held_out_digits_the_demo_vit_never_trained_on():
    """The demo's, the README's and the serving tests' example digits come from the test split
    (they were drawn from all digits, so 8 of the demo's 8 were training images)."""
    from jaxserve.datasets import digits_examples

    digits = prepare_digits((32, 32, 1))
    held_out = {x.tobytes() for x in digits.test.images}
    images, labels = digits_examples((32, 32, 1), count=len(held_out), seed=5)
    normalised = ((images - digits.pixel_mean) / digits.pixel_std).astype(np.float32)
    assert {x.tobytes() for x in normalised} == held_out
    assert sorted(labels.tolist()) == sorted(digits.test.labels.tolist())


def test_training_smoke_and_checkpoint_round_trip(tmp_path):
    metrics = train("vit-tiny-test", tmp_path / "ckpt", epochs=2, seed=0, progress=False)
    losses = metrics["epoch_losses"]
    assert len(losses) == 2 and losses[1] < losses[0]
    config, model = load_vit_checkpoint(tmp_path / "ckpt")
    assert config == VIT_CONFIGS["vit-tiny-test"]
    test = prepare_digits((config.image_size, config.image_size, config.num_channels)).test
    assert evaluate(model, test.images, test.labels) == metrics["test_accuracy"]
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["config_name"] == "vit-tiny-test" and set(meta["normalisation"]) == {"mean", "std"}


def test_serving_loads_the_demo_vit_without_the_training_stack(monkeypatch):
    """A serving host needs no training data pipeline: the image runtime loads the shipped
    checkpoint with grain unimportable and the training modules unloaded (it used to import
    the training script, and through it grain, just to read the checkpoint)."""
    import sys

    from jaxserve.registry import load_image_runtime
    from jaxserve.sched.base import ShapeGrid

    monkeypatch.setitem(sys.modules, "grain", None)  # `import grain` now raises ImportError
    for name in [m for m in sys.modules if m == "training" or m.startswith("training.")]:
        monkeypatch.delitem(sys.modules, name)
    rt = load_image_runtime(grid=ShapeGrid((1,)))
    assert sorted(rt.heads) == ["digits", "inverted", "parity"]
    assert not any(m.startswith("training") for m in sys.modules)
