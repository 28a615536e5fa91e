"""Polymorph table: bucketing, padding invariance, and no compiles after warmup."""

import numpy as np
import pytest

from jaxserve.compile_cache import compile_count
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.polymorph import NotWarmError, PolymorphTable, pad_token_batch, unpad_rows
from jaxserve.sched.base import Cell, ShapeGrid, bucket_for_length
from jaxserve.servables import bert_servable, weights_of

GRID = ShapeGrid(batch_sizes=(1, 4), seq_buckets=(16, 32, 64))


@pytest.fixture(scope="module")
def table(minilm):
    cfg, model = minilm
    t = PolymorphTable(bert_servable("minilm-l6", cfg, GRID))
    t.warmup()
    return t, weights_of(model)


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    return TextTokenizer(minilm_dir / "tokenizer.json")


def test_bucket_for_length_picks_smallest_fitting_bucket():
    assert bucket_for_length(1, (16, 32, 64)) == 16
    assert bucket_for_length(16, (16, 32, 64)) == 16
    assert bucket_for_length(17, (64, 16, 32)) == 32
    with pytest.raises(ValueError, match="largest bucket 64"):
        bucket_for_length(65, (16, 32, 64))


def test_cell_for_uses_the_same_rule_as_the_grid():
    assert GRID.cell_for(3, 20) == Cell(4, 32)
    assert GRID.cell_for(1, 64) == Cell(1, 64)
    assert set(GRID.cells()) == {Cell(b, s) for b in (1, 4) for s in (16, 32, 64)}
    with pytest.raises(ValueError):
        GRID.cell_for(5, 10)


def test_same_sentence_same_output_in_every_bucket(table, tokenizer):
    t, weights = table
    ids = tokenizer.encode(["Driverless cars are not worth the risk."])[0]
    outs = []
    for cell in GRID.cells():
        if cell.seq < len(ids):
            continue
        # the sentence shares the batch with padding rows and, at batch 4, with another input
        others = [ids] + ([tokenizer.encode(["a different, somewhat longer input sentence here"])[0]] if cell.batch > 1 else [])
        out = unpad_rows(t.run(cell, weights, *pad_token_batch(others, cell)), len(others))
        outs.append(out["embedding"][0])
    assert len(outs) == 6
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], atol=1e-5)


def test_no_compiles_after_warmup(table, tokenizer):
    t, weights = table
    before = compile_count()
    texts = ["short", "a medium length sentence about autonomous cars", "x " * 30]
    for text in texts:
        ids = tokenizer.encode([text])
        cell = GRID.cell_for(1, len(ids[0]))
        t.run(cell, weights, *pad_token_batch(ids, cell))
    ids = tokenizer.encode(texts)
    cell = GRID.cell_for(len(ids), max(map(len, ids)))
    t.run(cell, weights, *pad_token_batch(ids, cell))
    assert compile_count() == before


def test_cell_outside_the_grid_is_an_error_not_a_compile(table):
    t, weights = table
    before = compile_count()
    with pytest.raises(NotWarmError):
        t.executable(Cell(2, 16))
    assert compile_count() == before


def test_padding_rejects_inputs_that_do_not_fit():
    with pytest.raises(ValueError, match="bucket 16"):
        pad_token_batch([[1] * 17], Cell(1, 16))
    with pytest.raises(ValueError, match="batch 1"):
        pad_token_batch([[1], [2]], Cell(1, 16))
    ids, mask = pad_token_batch([[5, 6, 7]], Cell(2, 4))
    assert ids.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
