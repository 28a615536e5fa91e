"""OTAS prompt repository, per-(gamma, batch) ViT executables with per-sample prompts and heads,
prompt training with a frozen backbone, and accuracy profiling (jaxserve/prompts.py,
jaxserve/servables.py, jaxserve/runtime.py, jaxserve/prompt_training.py).

Everything runs on vit-tiny-test (16x16x3 images, 16 patches, 2 layers, D=32) so the file
compiles a handful of tiny executables and stays fast.
"""

import argparse

import numpy as np
import pytest
from flax import nnx

from jaxserve.compile_cache import compile_count
from jaxserve.datasets import ImageSplit
from jaxserve.models.vit import VIT_CONFIGS, init_vit
from jaxserve.polymorph import NotWarmError, PolymorphTable
from jaxserve.prompts import PromptEntry, PromptRepository, profile_accuracy
from jaxserve.runtime import ImageRuntime, TaskHead
from jaxserve.sched.base import Cell, ShapeGrid
from jaxserve.servables import vit_servable, weights_of

CONFIG = VIT_CONFIGS["vit-tiny-test"]
L, D = CONFIG.num_layers, CONFIG.hidden_size
GRID = ShapeGrid(batch_sizes=(1, 4), gammas=(-2, 0, 2))
TASKS = {"ten": tuple("abcdefghij"), "two": ("no", "yes")}


def _repository(seed=0, mode="replace") -> PromptRepository:
    rng = np.random.default_rng(seed)
    repo = PromptRepository(CONFIG.key(), L, D, mode)
    for task, labels in TASKS.items():
        for p in (0, 2):
            prompts = rng.normal(size=(L, p, D)).astype(np.float32) if p else None
            w = rng.normal(size=(D, len(labels))).astype(np.float32)
            b = rng.normal(size=(len(labels),)).astype(np.float32)
            repo.add(PromptEntry(task, p, prompts, w, b, accuracy=0.5), labels)
    return repo


@pytest.fixture(scope="module")
def model():
    return init_vit(CONFIG, seed=0)


@pytest.fixture(scope="module")
def runtime(model):
    repo = _repository()
    table = PolymorphTable(vit_servable("tiny", CONFIG, GRID, repo.prompt_mode, repo.num_classes))
    table.warmup()
    heads = {t: TaskHead(t, labels, None, None, feature="logits") for t, labels in repo.labels.items()}
    shape = (CONFIG.image_size, CONFIG.image_size, CONFIG.num_channels)
    return ImageRuntime("tiny", table, weights_of(model), heads, prompts=repo, image_shape=shape, pixel_mean=0.5,
                        pixel_std=0.25)


@pytest.fixture(scope="module")
def images():
    shape = (6, CONFIG.image_size, CONFIG.image_size, CONFIG.num_channels)
    return np.random.default_rng(1).random(shape, dtype=np.float32)


# ------------------------------------------------------------------------------ repository


def test_gather_stacks_each_samples_prompts_and_padded_head():
    repo = _repository()
    prompts, w, b = repo.gather(["two", "ten", "two"], gamma=2, batch=4)
    assert prompts.shape == (4, L, 2, D) and w.shape == (4, D, 10) and b.shape == (4, 10)
    for row, task in enumerate(["two", "ten", "two"]):
        e = repo.entry(task, 2)
        np.testing.assert_array_equal(prompts[row], e.prompts)
        np.testing.assert_array_equal(w[row, :, : len(TASKS[task])], e.head_w)
        np.testing.assert_array_equal(b[row, : len(TASKS[task])], e.head_b)
    assert not w[0, :, 2:].any() and not b[0, 2:].any()  # the 2-class head is zero-padded
    # gamma <= 0 (merging or vanilla): heads only, the task's un-prompted (P = 0) head
    for gamma in (-2, 0):
        w0, b0 = repo.gather(["ten"], gamma=gamma, batch=1)
        np.testing.assert_array_equal(w0[0], repo.entry("ten", 0).head_w)
    with pytest.raises(KeyError, match="unknown task"):
        repo.gather(["nope"], 0, 1)
    with pytest.raises(ValueError):
        repo.gather(["ten"] * 5, 0, 4)


def test_missing_prompt_counts_are_reported_and_entries_validated():
    repo = _repository()
    assert repo.missing_for((-2, 0, 2)) == []
    assert repo.missing_for((4,)) == [("ten", 4), ("two", 4)]
    with pytest.raises(ValueError):
        PromptEntry("ten", 2, None, np.zeros((D, 10), np.float32), np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="labels"):
        repo.add(PromptEntry("two", 0, None, np.zeros((D, 3), np.float32), np.zeros(3, np.float32)), ("a", "b", "c"))


def test_repository_round_trips_through_orbax(tmp_path):
    repo = _repository(seed=3, mode="accumulate")
    repo.meta = {"settings": {"epochs": 1}}
    repo.save(tmp_path / "repo")
    back = PromptRepository.load(tmp_path / "repo", config_key=CONFIG.key())
    assert back.prompt_mode == "accumulate" and back.labels == repo.labels and back.meta["settings"]["epochs"] == 1
    assert set(back.entries) == set(repo.entries)
    for key, e in repo.entries.items():
        f = back.entries[key]
        np.testing.assert_array_equal(f.head_w, e.head_w)
        if e.prompts is not None:
            np.testing.assert_array_equal(f.prompts, e.prompts)
        assert f.accuracy == e.accuracy
    with pytest.raises(ValueError, match="another backbone"):
        PromptRepository.load(tmp_path / "repo", config_key=VIT_CONFIGS["vit-demo"].key())


# ------------------------------------------------------------------------------ executables


def test_one_executable_per_gamma_and_batch(runtime):
    table = runtime.table
    assert table.warm and len(table._executables) == len(GRID.gammas) * len(GRID.batch_sizes)
    variants = {table.servable.variant_of(c) for c in GRID.cells()}
    assert len(variants) == len(GRID.gammas)
    with pytest.raises(NotWarmError):
        table.executable(Cell(4, 0, 4))


@pytest.mark.parametrize("gamma", GRID.gammas)
def test_mixed_task_batch_runs_the_chosen_cell_without_compiling(runtime, images, gamma):
    """One call of the (4, gamma) executable serves a batch mixing tasks; each row equals that
    sample run alone through the (1, gamma) executable with its own task's prompts and head,
    taken straight from the repository entry; nothing compiles."""
    tasks = ["ten", "two", "two"]
    before = compile_count()
    out = runtime.execute(Cell(4, 0, gamma), list(images[:3]), tasks)
    for i, (item, task) in enumerate(zip(out.items, tasks)):
        e = runtime.prompts.entry(task, gamma)
        pixels = (images[i : i + 1] - 0.5) / 0.25
        args = (pixels,) + (() if e.prompts is None else (e.prompts[None],))
        c = runtime.prompts.num_classes
        head_w = np.zeros((1, D, c), np.float32)
        head_b = np.zeros((1, c), np.float32)
        head_w[0, :, : e.head_w.shape[1]], head_b[0, : e.head_b.shape[0]] = e.head_w, e.head_b
        alone = runtime.table.run(Cell(1, 0, gamma), runtime.weights, *args, head_w, head_b)["logits"][0]
        np.testing.assert_allclose(item["logits"][: len(TASKS[task])], alone[: len(TASKS[task])], atol=2e-4)
        assert len(item["probabilities"]) == len(TASKS[task]) and item["label"] in TASKS[task]
        assert abs(float(item["probabilities"].sum()) - 1) < 1e-5
    assert compile_count() == before
    assert not np.allclose(out.items[1]["logits"][:2], out.items[2]["logits"][:2], atol=1e-4)  # real images differ


def test_gamma_changes_what_runs(runtime, images):
    """Merging and prompting really happen in their cells: the same inputs give other logits."""
    logits = {g: runtime.execute(Cell(1, 0, g), [images[0]], ["ten"]).items[0]["logits"] for g in GRID.gammas}
    assert not np.allclose(logits[-2], logits[0], atol=1e-4)
    assert not np.allclose(logits[2], logits[0], atol=1e-4)


def test_prompts_are_arguments_not_constants(runtime, images):
    """Swapping a task's prompts in the repository changes the answer of the same executable."""
    repo = runtime.prompts
    first = runtime.execute(Cell(1, 0, 2), [images[0]], ["ten"]).items[0]["logits"].copy()
    e = repo.entry("ten", 2)
    repo.add(PromptEntry("ten", 2, -e.prompts, e.head_w, e.head_b), TASKS["ten"])
    try:
        before = compile_count()
        second = runtime.execute(Cell(1, 0, 2), [images[0]], ["ten"]).items[0]["logits"]
        assert compile_count() == before
        assert not np.allclose(first, second, atol=1e-4)
    finally:
        repo.add(e, TASKS["ten"])


def test_profile_accuracy_matches_a_manual_count(runtime, images):
    labels = np.array([0, 1, 1, 0, 1, 0], np.int32)
    split = ImageSplit(images, labels)
    profile = profile_accuracy(runtime, {"two": split}, gammas=(-2, 2))
    assert set(profile.accuracy) == {("two", -2), ("two", 2)}
    for g in (-2, 2):
        got = []
        for start in range(0, 6, 4):
            chunk = list(images[start : start + 4])
            out = runtime.execute(GRID.cell_for(len(chunk), 0, g), chunk, ["two"] * len(chunk))
            got += [("no", "yes").index(it["label"]) for it in out.items]
        assert profile.of("two", g) == pytest.approx(float(np.mean(np.array(got) == labels)))


# ------------------------------------------------------------------------------ training


def test_prompt_training_freezes_the_backbone_and_learns(model):
    """Two tiny tasks, P in {0, 2}, two epochs: every (task, P) entry exists, the backbone is
    untouched, the P = 2 head starts from the P = 0 head and both move off it."""
    from jaxserve.prompt_training import PromptSettings, train_repository

    rng = np.random.default_rng(0)
    n = 64
    images = rng.random((n, CONFIG.image_size, CONFIG.image_size, CONFIG.num_channels), dtype=np.float32)
    bright = (images.mean(axis=(1, 2, 3)) > np.median(images.mean(axis=(1, 2, 3)))).astype(np.int32)
    split = ImageSplit(images, bright)
    before = {k: np.asarray(v).copy() for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    repo = train_repository(CONFIG, model, {"bright": (split, split, ("dark", "bright")),
                                            "copy": (split, split, ("dark", "bright"))},
                            prompt_counts=(2,), pixel_mean=0.5, pixel_std=0.25,
                            settings=PromptSettings(epochs=2, batch_size=16, learning_rate=0.05),
                            progress=False)
    after = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert set(repo.entries) == {("bright", 0), ("bright", 2), ("copy", 0), ("copy", 2)}
    e0, e2 = repo.entry("bright", 0), repo.entry("bright", 2)
    assert e2.prompts.shape == (L, 2, D) and e0.prompts is None
    assert np.abs(e0.head_w).sum() > 0 and not np.allclose(e2.head_w, e0.head_w)
    assert all(0.0 <= e.accuracy <= 1.0 for e in repo.entries.values())
    assert repo.meta["prompt_counts"] == [0, 2]


def test_each_prompt_count_trains_from_its_own_copy_of_the_base_head(model):
    """The train step donates its params; every P > 0 fit starts from the same P = 0 head, so
    fit must not consume the caller's arrays (on a GPU the second P crashed: "Array has been
    deleted"). fit is called directly: through train_repository a zero-copy numpy view of the
    head happens to block donation on CPU and hides the bug."""
    import jax
    import jax.numpy as jnp

    from jaxserve.prompt_training import PromptSettings, _Trainer, init_prompts

    rng = np.random.default_rng(0)
    images = rng.random((32, CONFIG.image_size, CONFIG.image_size, CONFIG.num_channels), dtype=np.float32)
    split = ImageSplit(images, (images.mean(axis=(1, 2, 3)) > 0.5).astype(np.int32))
    graphdef, state = nnx.split(model)
    trainer = _Trainer(graphdef, state, CONFIG, "replace")
    base = {"head_w": jnp.full((D, 2), 0.1), "head_b": jnp.zeros((2,))}
    settings = PromptSettings(epochs=1, batch_size=16)
    for p in (2, 4):
        params = {**base, "prompts": jnp.asarray(init_prompts(CONFIG, p, p))}
        trained, losses, acc = trainer.fit(params, split, split, p, settings, f"P={p}", progress=False)
        assert trained["prompts"].shape == (L, p, D) and len(losses) == 1 and 0.0 <= acc <= 1.0
        assert not any(x.is_deleted() for x in jax.tree.leaves(base))
        assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    np.testing.assert_array_equal(np.asarray(base["head_w"]), np.float32(0.1))  # the base is left as it was
    # a batch larger than the split would train nothing (remainders are dropped) and report NaN
    with pytest.raises(ValueError, match="--batch-size 64 exceeds the 32 training images"):
        trainer.fit(params, split, split, 2, PromptSettings(epochs=1, batch_size=64), "P=2", progress=False)


def test_cli_defaults_match_prompt_settings():
    from jaxserve.cli import train_prompts_arguments
    from jaxserve.datasets import DIGIT_TASKS
    from jaxserve.prompt_training import PromptSettings

    parser = argparse.ArgumentParser()
    train_prompts_arguments(parser)
    args = parser.parse_args([])
    s = PromptSettings()
    assert (args.epochs, args.batch_size, args.lr, args.optimizer) == (s.epochs, s.batch_size, s.learning_rate,
                                                                       s.optimizer)
    assert args.tasks.split(",") == list(DIGIT_TASKS)
