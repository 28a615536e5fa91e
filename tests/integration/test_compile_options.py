"""Per-cell XLA compile options: YNNPACK off where it is slower, in the cache key, and
results that do not depend on it."""

import dataclasses
import json
import time

import jax
import numpy as np
from flax import nnx

from jaxserve.compile_cache import CompileCache, compile_count
from jaxserve.models.bert import BERT_CONFIGS, Bert
from jaxserve.polymorph import PolymorphTable, _best_times, options_label, ynn_off
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


def _tiny_table(tmp_path=None, options_of=None, tune=False, use_xla_cache=True, **replace):
    cfg = BERT_CONFIGS["bert-tiny-test"]
    sv = bert_servable("bert-tiny-test", cfg, ShapeGrid(batch_sizes=(1, 64), seq_buckets=(64,)))
    if options_of is not None:
        replace["options_of"] = options_of
    sv = dataclasses.replace(sv, **replace)
    return PolymorphTable(sv, CompileCache(tmp_path, use_xla_cache) if tmp_path else None, tune=tune), cfg


def test_the_large_cell_compiles_without_ynn_and_agrees_with_the_default(tmp_path):
    """The fixed rule (a table that does not tune)."""
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


# ------------------------------------------------------------------ warmup's tuning

SLOW = {"xla_backend_optimization_level": "0"}  # unoptimised LLVM: several times slower element-wise code


def test_tuning_keeps_the_faster_candidate_and_loads_it_back(tmp_path):
    """The slow candidate comes first, so a tuner that kept the first (or the last timed)
    would keep it. The entry stores the winner; a second start loads it with no compile and
    no timing, and the manifest says what won and what each candidate took. (Without the XLA
    cache, whose process-wide directory earlier tests filled: a winner loaded from there is
    not serialized, see CompileCache.)"""
    both = lambda cell: (SLOW, {})  # noqa: E731
    table, cfg = _tiny_table(tmp_path / "c", tune=True, use_xla_cache=False, option_candidates=both)
    before = compile_count()
    rows = {r.cell: r for r in table.warmup()}
    assert compile_count() - before == 2 * len(rows)  # each candidate compiled once, nothing else
    for cell in (Cell(1, 64), Cell(64, 64)):
        row = rows[cell.label()]
        assert row.compile_options == {} and table.stats[cell].compile_options == {}
        assert set(row.tuning_ms) == {"default", options_label(SLOW)}
        assert row.tuning_ms["default"] < row.tuning_ms[options_label(SLOW)]
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())["entries"]
    assert len(manifest) == 2 and all(e["compile_options"] == {} and len(e["tuning_ms"]) == 2 for e in manifest)

    again, _ = _tiny_table(tmp_path / "c", tune=True, use_xla_cache=False, option_candidates=both)
    before = compile_count()
    again_rows = {r.cell: r for r in again.warmup()}
    assert compile_count() == before
    assert {r.source for r in again_rows.values()} == {"serialized"}
    assert {r.cell: (r.compile_options, r.tuning_ms) for r in again_rows.values()} == \
        {r.cell: (r.compile_options, r.tuning_ms) for r in rows.values()}
    weights = weights_of(Bert(cfg, rngs=nnx.Rngs(0)))
    ids = np.random.default_rng(1).integers(1, cfg.vocab_size, (64, 64)).astype(np.int32)
    fixed, _ = _tiny_table(options_of=lambda cell: {})
    fixed.warm_cell(Cell(64, 64))
    np.testing.assert_allclose(again.run(Cell(64, 64), weights, ids, np.ones_like(ids))["embedding"],
                               fixed.run(Cell(64, 64), weights, ids, np.ones_like(ids))["embedding"], atol=1e-6)


def test_the_key_names_the_candidates_not_the_winner(tmp_path):
    """A tuning table and a fixed-rule one never share entries (a warmup job and its server
    must agree on --no-tune); candidates that coincide on this backend, or none at all, are
    no tuning, and the key is the fixed rule's."""
    cell = Cell(64, 64)
    tuned, _ = _tiny_table(tune=True, option_candidates=lambda c: (SLOW, {}))
    fixed, _ = _tiny_table(tune=False, option_candidates=lambda c: (SLOW, {}))
    assert tuned.candidates(cell) == (SLOW, {}) and fixed.candidates(cell) == (fixed.servable.options_of(cell),)
    assert tuned._key(cell)[0] != fixed._key(cell)[0]
    for same in (lambda c: ({}, {}), lambda c: ()):
        table, _ = _tiny_table(tune=True, options_of=lambda c: {}, option_candidates=same)
        assert table.candidates(cell) == ({},)
        assert table._key(cell)[0] == _tiny_table(tune=False, options_of=lambda c: {})[0]._key(cell)[0]


def test_the_shipped_servables_offer_ynn_on_and_off_on_the_cpu():
    from jaxserve.servables import vit_servable
    from jaxserve.models.vit import VIT_CONFIGS

    cell = Cell(8, 64)
    f32, _ = _tiny_table(tune=True)
    bf16 = PolymorphTable(bert_servable("bert-tiny-test", BERT_CONFIGS["bert-tiny-test"],
                                        ShapeGrid((8,), (64,)), "bf16"))
    vit = PolymorphTable(vit_servable("vit-tiny-test", VIT_CONFIGS["vit-tiny-test"], ShapeGrid((8,), gammas=(0,))))
    if jax.default_backend() == "cpu":
        assert f32.candidates(cell) == ({}, OFF) and vit.candidates(Cell(8, 0)) == ({}, OFF)
        assert bf16.candidates(cell) == ({}, ynn_off(True, keep=("INDIVIDUAL_DOT",)))  # never all of YNN off
    else:  # nothing to choose between elsewhere
        assert len(f32.candidates(cell)) == 1 and len(bf16.candidates(cell)) == 1


def test_best_times_ranks_by_each_candidates_best_call():
    """A candidate twice as slow is ranked so even when one of the fast one's calls is hit by
    a one-off stall (another tenant): the minimum over rounds discounts it."""
    stalled = iter([0.002, 0.05])  # the fast one's second call (round 2) stalls

    def fast():
        time.sleep(next(stalled, 0.002))
        return np.zeros(1)

    def slow():
        time.sleep(0.004)
        return np.zeros(1)

    best = _best_times([fast, slow], (), min_seconds=0.0)
    assert best[0] < best[1] < 0.05
