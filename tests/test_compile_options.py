"""Per-cell XLA compile options: YNNPACK off where it is slower, in the cache key, and
results that do not depend on it."""

import dataclasses

import jax
import numpy as np
from flax import nnx

from jaxserve.compile_cache import CompileCache
from jaxserve.models.bert import BERT_CONFIGS, Bert
from jaxserve.polymorph import PolymorphTable, ynn_off
from jaxserve.sched.base import Cell, ShapeGrid
from jaxserve.servables import bert_options, bert_servable, vit_options, weights_of

OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}


def test_ynn_off_only_where_asked_and_only_on_the_cpu():
    assert ynn_off(True, "cpu") == OFF
    assert ynn_off(False, "cpu") == {}
    assert ynn_off(True, "gpu") == {} and ynn_off(True, "tpu") == {}


def test_each_model_family_has_its_own_crossover():
    if jax.default_backend() != "cpu":
        return
    assert bert_options(Cell(32, 128)) == OFF and bert_options(Cell(16, 256)) == OFF  # 4096 rows
    assert bert_options(Cell(32, 64)) == {} and bert_options(Cell(8, 256)) == {}  # 2048 rows
    assert vit_options(Cell(4, 0)) == OFF and vit_options(Cell(32, 0, -2)) == OFF
    assert vit_options(Cell(2, 0)) == {} and vit_options(Cell(1, 0, 4)) == {}


def _tiny_table(tmp_path=None, options_of=None):
    cfg = BERT_CONFIGS["bert-tiny-test"]
    sv = bert_servable("bert-tiny-test", cfg, ShapeGrid(batch_sizes=(1, 64), seq_buckets=(64,)))
    if options_of is not None:
        sv = dataclasses.replace(sv, options_of=options_of)
    return PolymorphTable(sv, CompileCache(tmp_path) if tmp_path else None), cfg


def test_the_large_cell_compiles_without_ynn_and_agrees_with_the_default(tmp_path):
    table, cfg = _tiny_table(tmp_path / "a")
    rows = {r.cell: r for r in table.warmup()}
    default, _ = _tiny_table(options_of=lambda cell: {})
    default.warmup()
    big, small = Cell(64, 64), Cell(1, 64)
    if jax.default_backend() == "cpu":
        assert table.executable(big).as_text().count("__ynn_fusion") == 0
        assert default.executable(big).as_text().count("__ynn_fusion") > 0
        assert table.executable(small).as_text().count("__ynn_fusion") > 0
    weights = weights_of(Bert(cfg, rngs=nnx.Rngs(0)))
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (64, 64)).astype(np.int32)
    mask = np.ones_like(ids)
    ours, ref = table.run(big, weights, ids, mask), default.run(big, weights, ids, mask)
    np.testing.assert_allclose(ours["embedding"], ref["embedding"], atol=1e-5)
    # the options are part of the key: the two tables never share an entry
    assert table._key(big)[0] != default._key(big)[0]
    assert table._key(small)[0] == default._key(small)[0]
    # and the serialized executable loads back with them
    again, _ = _tiny_table(tmp_path / "a")
    assert {r.source for r in again.warmup()} == {"serialized"}
    assert again.executable(big).as_text().count("__ynn_fusion") == table.executable(big).as_text().count("__ynn_fusion")
    np.testing.assert_allclose(again.run(big, weights, ids, mask)["embedding"], ours["embedding"], atol=0)
    # the manifest says which options each cell was compiled with
    if jax.default_backend() == "cpu":
        assert rows[big.label()].compile_options == OFF and rows[small.label()].compile_options == {}
