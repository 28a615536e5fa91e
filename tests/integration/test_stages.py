"""Layer-range stage executables (jaxserve/stages.py): chained stages answer as the whole model
on the real MiniLM and demo-ViT weights (ToMe and prompts included), each stage holds only its
own parameters, the range is part of the compile-cache key, and bad cuts are refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.compile_cache import CompileCache, compile_count
from jaxserve.datasets import digits_examples
from jaxserve.models.vit import gamma_settings, load_vit_checkpoint, token_counts
from jaxserve.polymorph import PolymorphTable
from jaxserve.registry import load_image_runtime, load_text_runtime, vit_demo_dir
from jaxserve.sched.base import Cell, ShapeGrid, Stage
from jaxserve.stages import Activations, build_stage_runtimes, split_stages

TEXT_GRID = ShapeGrid(batch_sizes=(1, 4), seq_buckets=(16, 32))
IMAGE_GRID = ShapeGrid(batch_sizes=(4,), gammas=(-3, 2))  # ToMe merging, prompts; ToMe cells compile slowly
TEXT_SPLITS = ((3,), (2, 4))  # MiniLM has 6 layers
IMAGE_SPLITS = ((2,), (1, 3))  # the demo ViT has 4
ATOL = 1e-5


def token_payloads(cell: Cell, seed: int = 0) -> list[list[int]]:
    """Real-looking ids: a full batch minus one (padding rows too, except at batch 1), the
    first item filling the bucket, the others shorter."""
    rng = np.random.default_rng(seed + cell.batch * 100 + cell.seq)
    n = max(1, cell.batch - 1)
    lengths = [cell.seq] + [int(rng.integers(3, cell.seq)) for _ in range(n - 1)]
    return [[101, *rng.integers(1000, 30000, size=length - 2).tolist(), 102] for length in lengths]


def assert_items_equal(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for key, value in w.items():
            if isinstance(value, np.ndarray):
                np.testing.assert_allclose(g[key], value, atol=ATOL, rtol=0, err_msg=key)
            else:
                assert g[key] == value, key


def run_chain(runners, stages, cell, payloads, tasks):
    """Each stage on its predecessor's activations; the last one's items."""
    carry = None
    for i, stage in enumerate(stages):
        result = runners[stage].execute(cell, payloads if stage.first else [], tasks, carry)
        if stage.last:
            assert result.carry is None
            return result.items
        assert result.items is None and result.carry.count == len(tasks)
        assert isinstance(result.carry.arrays["hidden"], jax.Array)  # stays on the device in one process
        carry = result.carry


# ------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def text():
    rt = load_text_runtime("minilm-l6", None, TEXT_GRID, tune=False)
    assert "sentiment" in rt.heads
    chains = {}
    for cuts in TEXT_SPLITS:
        stages = split_stages(rt.name, rt.num_layers, cuts)
        chains[cuts] = (stages, build_stage_runtimes(rt, stages, None))
    return rt, chains


@pytest.fixture(scope="module")
def image():
    rt = load_image_runtime("vit-demo", None, IMAGE_GRID, tune=False)
    chains = {}
    for cuts in IMAGE_SPLITS:
        stages = split_stages(rt.name, rt.num_layers, cuts)
        chains[cuts] = (stages, build_stage_runtimes(rt, stages, None))
    return rt, chains


# ------------------------------------------------------------------------------ chains = whole model

@pytest.mark.parametrize("cuts", TEXT_SPLITS)
def test_chained_minilm_stages_equal_the_whole_model_at_every_cell(text, cuts):
    rt, chains = text
    stages, runners = chains[cuts]
    for cell in TEXT_GRID.cells():
        payloads = token_payloads(cell)
        tasks = ["sentiment" if i % 2 == 0 else "" for i in range(len(payloads))]
        want = rt.execute(cell, payloads, tasks).items
        assert_items_equal(run_chain(runners, stages, cell, payloads, tasks), want)


def test_activations_are_rebatched_between_stages(text):
    """Rows of one step's activations, gathered and concatenated, run in another batch of the
    next stage (smaller or padded) and answer as the whole model does for those rows."""
    rt, chains = text
    (s0, s1), runners = chains[(3,)]
    cell = Cell(4, 16)
    payloads = token_payloads(cell, seed=7)  # 3 items in a batch of 4
    tasks = ["", "sentiment", ""]
    want = rt.execute(cell, payloads, tasks).items
    carry = runners[s0].execute(cell, payloads, tasks).carry
    assert carry.nbytes() == 4 * 16 * 384 * 4 + 4 * 16 * 4  # hidden float32 + mask int32, padded to the cell
    alone = runners[s1].execute(Cell(1, 16), [], [tasks[1]], carry.rows([1])).items
    assert_items_equal(alone, [want[1]])
    mixed = Activations.concat([carry.rows([2]), carry.rows([0, 1])])
    assert mixed.count == 3 and mixed.arrays["hidden"].shape[0] == 3
    got = runners[s1].execute(cell, [], [tasks[2], tasks[0], tasks[1]], mixed).items
    assert_items_equal(got, [want[2], want[0], want[1]])
    with pytest.raises(IndexError):
        carry.rows([3])  # a padding row is no item's


def test_activations_from_another_bucket_are_refused(text):
    _, chains = text
    (s0, s1), runners = chains[(3,)]
    carry = runners[s0].execute(Cell(1, 16), [[101, 2000, 102]], [""]).carry
    with pytest.raises(ValueError, match="do not fit"):
        runners[s1].execute(Cell(1, 32), [], [""], carry)
    with pytest.raises(ValueError, match="tasks"):
        runners[s1].execute(Cell(1, 16), [], ["", ""], carry)


@pytest.mark.parametrize("cuts", IMAGE_SPLITS)
def test_chained_vit_stages_equal_the_whole_model_with_tome_and_prompts(image, cuts):
    rt, chains = image
    stages, runners = chains[cuts]
    cfg, _ = load_vit_checkpoint(vit_demo_dir())
    images, _ = digits_examples(rt.image_shape, count=4, seed=1)
    task_names = list(rt.prompts.tasks)
    for cell in IMAGE_GRID.cells():
        n = max(1, cell.batch - 1)
        payloads, tasks = list(images[:n]), [task_names[i % len(task_names)] for i in range(n)]
        want = rt.execute(cell, payloads, tasks).items
        merge_r, num_prompts = gamma_settings(cfg, cell.gamma)
        counts = token_counts(cfg, merge_r, num_prompts, rt.prompts.prompt_mode)
        carry = None
        for stage in stages[:-1]:
            carry = runners[stage].execute(cell, payloads if stage.first else [], tasks, carry).carry
            # the next stage gets the token count this one produced at this gamma
            assert carry.arrays["hidden"].shape == (cell.batch, counts[stage.stop - 1], cfg.hidden_size)
            if cell.gamma < 0:  # ToMe's sizes travel with the tokens and still count every patch
                assert carry.arrays["hidden"].shape[1] < 1 + cfg.num_patches
                np.testing.assert_allclose(np.asarray(carry.arrays["size"]).sum(axis=1), 1 + cfg.num_patches)
            else:
                assert "size" not in carry.arrays
        got = runners[stages[-1]].execute(cell, [], tasks, carry).items
        assert_items_equal(got, want)


def test_a_whole_model_stage_is_the_model_itself(text):
    rt, _ = text
    (whole,) = split_stages(rt.name, rt.num_layers, ())
    assert whole.whole and whole == Stage(rt.name, 0, rt.num_layers, rt.num_layers)
    before = compile_count()
    runner = build_stage_runtimes(rt, [whole], None)[whole]
    assert compile_count() == before and runner.table is rt.table and runner.weights is rt.weights
    cell = Cell(1, 16)
    payloads = token_payloads(cell)
    assert_items_equal(runner.execute(cell, payloads, ["sentiment"]).items,
                       rt.execute(cell, payloads, ["sentiment"]).items)


# ------------------------------------------------------------------------------ weights

def _paths(state) -> set[str]:
    return {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(state)}


@pytest.mark.parametrize("which", ["text", "image"])
def test_a_stage_holds_only_its_own_parameters(text, image, which):
    rt, chains = text if which == "text" else image
    layers_key = "layers" if which == "text" else "blocks"
    whole_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(rt.weights))
    whole_flat = dict(nnx.to_flat_state(rt.weights))
    for stages, runners in chains.values():
        assert sum(runners[s].param_bytes() for s in stages) == whole_bytes
        for stage in stages:
            weights = runners[stage].weights
            assert len(weights[layers_key]) == stage.stop - stage.start
            names = {p.split("/")[0] for p in _paths(weights)}
            embeddings = {"word_embeddings", "position_embeddings", "token_type_embeddings", "embed_norm"} \
                if which == "text" else {"patch_embed", "cls_token", "pos_embed"}
            if stage.first:
                assert embeddings <= names
            else:
                assert not embeddings & names
            if which == "image":
                assert ({"norm", "head"} <= names) == stage.last
            for path, variable in nnx.to_flat_state(weights):  # layer j of the stage is the model's start + j
                source = (path[0], path[1] + stage.start, *path[2:]) if len(path) > 1 and isinstance(path[1], int) \
                    else path
                assert variable.get_value() is whole_flat[source].get_value()
        assert sum(len(runners[s].weights[layers_key]) for s in stages) == rt.num_layers


# ------------------------------------------------------------------------------ compile cache

def test_the_stage_range_is_part_of_the_cache_key(text):
    rt, _ = text
    stages = split_stages(rt.name, rt.num_layers, (2, 3, 4))  # [2:3] and [3:4]: the same shapes and program
    servables = [rt.table.servable.stage_servable(s.start, s.stop) for s in stages]
    keys = [PolymorphTable(s).keys() for s in servables]
    assert [s.name for s in servables] == [s.label() for s in stages]
    everything = set(rt.table.keys())
    for k in keys:
        assert len(k) == len(TEXT_GRID.cells())
        assert not k & everything  # no stage shares an entry with another stage or the whole model
        everything |= k


def test_stages_reload_from_the_cache_without_compiling(tmp_path):
    grid = ShapeGrid(batch_sizes=(2,), seq_buckets=(16,))
    rt = load_text_runtime("minilm-l6", None, grid, tune=False)
    stages = split_stages(rt.name, rt.num_layers, (3,))
    cell = Cell(2, 16)
    payloads = token_payloads(cell)

    # without jax's process-wide persistent cache, which an earlier test may have pointed elsewhere
    before = compile_count()
    cold = build_stage_runtimes(rt, stages, CompileCache(tmp_path / "cache", use_xla_cache=False))
    assert compile_count() - before == len(stages)
    assert all(cold[s].table.stats[cell].source == "compiled" for s in stages)
    assert len(list((tmp_path / "cache" / "executables").glob("*.json"))) == len(stages)  # one entry each

    before = compile_count()
    warm = build_stage_runtimes(rt, stages, CompileCache(tmp_path / "cache", use_xla_cache=False))
    assert compile_count() == before
    assert all(warm[s].table.stats[cell].source == "serialized" for s in stages)
    assert_items_equal(run_chain(warm, stages, cell, payloads, [""] * len(payloads)),
                       run_chain(cold, stages, cell, payloads, [""] * len(payloads)))


# ------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("num_layers, cuts, message", [
    (6, (3, 3), "strictly increasing"),
    (6, (4, 2), "strictly increasing"),
    (6, (0,), "outside"),
    (6, (6,), "outside"),
    (6, (-1,), "outside"),
    (6, (2.5,), "integers"),
    (0, (), "positive integer"),
])
def test_bad_boundaries_are_refused(num_layers, cuts, message):
    with pytest.raises(ValueError, match=message):
        split_stages("m", num_layers, cuts)


def test_stages_of_another_model_or_depth_are_refused(text):
    rt, _ = text
    with pytest.raises(ValueError, match="not a stage of"):
        build_stage_runtimes(rt, [Stage("vit-demo", 0, 2, 4)], None)
    with pytest.raises(ValueError, match="not a stage of"):
        build_stage_runtimes(rt, [Stage(rt.name, 0, 2, 12)], None)
