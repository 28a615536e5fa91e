"""Per-cell XLA compile options: YNNPACK off where it is slower, in the cache key, and
results that do not depend on it."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve import polymorph
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


# Off / on time ratios measured on the 2-core Xeon the rules were fitted on (bench/RESULTS.md, 'The
# measurements behind the code's rules': servables.bert_options and servables.vit_options; median of
# interleaved runs, MiniLM and vit-demo; where a range was reported, both ends lie on the same side of 1 and
# its first is given). YNN off should win (ratio < 1) exactly where the rule turns it off.
BERT_MEASURED = {Cell(32, 128): 0.81, Cell(16, 256): 0.97, Cell(32, 256): 0.87,  # >= 4096 rows
                 Cell(8, 32): 1.15, Cell(8, 128): 1.02, Cell(32, 64): 1.01}  # below
VIT_MEASURED = {Cell(1, 0): 1.01, Cell(2, 0): 1.11, Cell(4, 0): 0.97, Cell(8, 0): 0.85, Cell(16, 0): 0.88,
                Cell(32, 0): 0.87}


def test_each_model_family_has_its_own_crossover():
    """Each rule agrees with every measurement behind it, and the two families differ: at a
    batch of 8 (of 32 tokens) BERT keeps YNNPACK (1.15) while ViT at a batch of 8 drops it
    (0.85). ViT counts images, not tokens: a batch of 32 at gamma -2 (fewer tokens) still drops
    it, one image at gamma 4 (more) keeps it. Off the CPU there is no YNNPACK: no cell gets an
    option."""
    off = OFF if jax.default_backend() == "cpu" else {}
    for cell, ratio in BERT_MEASURED.items():
        assert bert_options(cell) == (off if ratio < 1 else {}), (cell, ratio)
    for cell, ratio in VIT_MEASURED.items():
        assert vit_options(cell) == (off if ratio < 1 else {}), (cell, ratio)
    assert bert_options(Cell(8, 32)) == {} and vit_options(Cell(8, 0)) == off
    assert vit_options(Cell(32, 0, -2)) == off and vit_options(Cell(1, 0, 4)) == {}


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
    # the options are part of the key: the two tables never share an entry where the options differ
    # (on the CPU at 64 x 64 = 4096 rows; elsewhere both tables compile with no option)
    assert (table._key(big)[0] != default._key(big)[0]) == (jax.default_backend() == "cpu")
    assert table._key(small)[0] == default._key(small)[0]
    # and the serialized executable loads back with them
    again, _ = _tiny_table(tmp_path / "a")
    assert {r.source for r in again.warmup()} == {"serialized"}
    assert again.executable(big).as_text().count("__ynn_fusion") == table.executable(big).as_text().count("__ynn_fusion")
    np.testing.assert_allclose(again.run(big, weights, ids, mask)["embedding"], ours["embedding"], atol=0)
    # the manifest says which options each cell was compiled with: 64 x 64 = 4096 rows, YNN off on the CPU
    assert rows[big.label()].compile_options == (OFF if jax.default_backend() == "cpu" else {})
    assert rows[small.label()].compile_options == {}


# ------------------------------------------------------------------ warmup's tuning

SLOW = {"xla_backend_optimization_level": "0"}  # unoptimised LLVM: several times slower element-wise code


def test_tuning_keeps_the_faster_candidate_and_loads_it_back(tmp_path, monkeypatch):
    """Warmup compiles every candidate, times them (``_best_times``, here scripted: which one is
    faster is the machine's business, not the test's), keeps the fastest whichever place it has:
    at batch 1 the second candidate is faster, at batch 64 the first, so a tuner that kept the
    first (or the last timed) fails one of the two. The entry stores the winner; a second start
    loads it with no compile and no timing, and the manifest says what won and what each
    candidate took. (Without the XLA cache, whose process-wide directory earlier tests filled: a
    winner loaded from there is not serialized, see CompileCache.)"""
    both = lambda cell: (SLOW, {})  # noqa: E731
    scripted = {1: [0.003, 0.001], 64: [0.002, 0.005]}  # seconds per call of (SLOW, {}), by batch size
    timed = []

    def best_times(executables, args, **_):
        for ex in executables:  # every candidate was built and runs on the timing inputs
            jax.block_until_ready(ex(*args))
        timed.append(args[1].shape[0])  # (weights, ids [batch, seq], mask)
        return scripted[args[1].shape[0]]

    monkeypatch.setattr(polymorph, "_best_times", best_times)
    table, cfg = _tiny_table(tmp_path / "c", tune=True, use_xla_cache=False, option_candidates=both)
    before = compile_count()
    rows = {r.cell: r for r in table.warmup()}
    assert compile_count() - before == 2 * len(rows)  # each candidate compiled once, nothing else
    assert sorted(timed) == [1, 64]
    winners = {Cell(1, 64): {}, Cell(64, 64): SLOW}
    ms = {Cell(1, 64): {"default": 1.0, options_label(SLOW): 3.0},  # the scripted seconds, in ms
          Cell(64, 64): {"default": 5.0, options_label(SLOW): 2.0}}
    for cell in winners:
        row = rows[cell.label()]
        assert row.compile_options == winners[cell] and table.stats[cell].compile_options == winners[cell]
        assert row.tuning_ms == ms[cell]
    manifest = {e["cell"]: e for e in json.loads((tmp_path / "c" / "manifest.json").read_text())["entries"]}
    assert {c: (e["compile_options"], e["tuning_ms"]) for c, e in manifest.items()} == \
        {c.label(): (winners[c], ms[c]) for c in winners}

    again, _ = _tiny_table(tmp_path / "c", tune=True, use_xla_cache=False, option_candidates=both)
    before = compile_count()
    again_rows = {r.cell: r for r in again.warmup()}
    assert compile_count() == before and sorted(timed) == [1, 64]  # nothing compiled, nothing timed
    assert {r.source for r in again_rows.values()} == {"serialized"}
    assert {r.cell: (r.compile_options, r.tuning_ms) for r in again_rows.values()} == \
        {c.label(): (winners[c], ms[c]) for c in winners}
    # whichever options won, the answers are the default build's
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
    rule = OFF if jax.default_backend() == "cpu" else {}  # bert_options at 64 x 64 = 4096 rows
    assert tuned.candidates(cell) == (SLOW, {}) and fixed.candidates(cell) == (rule,)
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
        dots_only = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
        assert bf16.candidates(cell) == ({}, dots_only)  # never all of YNN off: YNN for single dots only
    else:  # nothing to choose between elsewhere
        assert len(f32.candidates(cell)) == 1 and len(bf16.candidates(cell)) == 1


class ScriptedClock:
    """Stands in for the ``time`` module ``_best_times`` reads: a virtual clock that only the
    scripted executables move."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_best_times_ranks_by_each_candidates_best_call(monkeypatch):
    """A candidate twice as slow is ranked so even when one of the fast one's calls is hit by
    a one-off stall (another tenant): the minimum over rounds discounts it. On an injected
    clock, so the figures are exact: one call per round (min_seconds 0): fast 2 ms then 50 ms,
    slow 4 ms twice -> best 2 ms and 4 ms. With min_seconds 9.5 ms a round repeats calls until
    9.5 ms have passed and takes the mean: a first call of 8 ms then 1 ms ones -> 3 calls in
    10 ms, 3.33 ms per call in round 1; round 2 (1 ms calls) -> 10 calls, 1 ms per call."""
    clock = ScriptedClock()
    monkeypatch.setattr(polymorph, "time", clock)

    def takes(seconds):
        def run():
            clock.now += next(seconds)
            return np.zeros(1)
        return run

    fast, slow = takes(iter([0.002, 0.05])), takes(iter([0.004, 0.004]))
    assert _best_times([fast, slow], (), min_seconds=0.0) == pytest.approx([0.002, 0.004])
    first_call_costs = takes(iter([0.008] + [0.001] * 12))
    assert _best_times([first_call_costs], (), min_seconds=0.0095) == pytest.approx([0.001])
    one_round = takes(iter([0.008] + [0.001] * 2))
    assert _best_times([one_round], (), rounds=1, min_seconds=0.0095) == pytest.approx([0.010 / 3])


def test_attention_tuning_times_both_forms_and_keeps_the_faster(tmp_path, monkeypatch):
    """With tune="attention", a short text cell's candidates are each YNN choice twice, with
    attention through the fused kernel and as XLA ops; a long cell keeps the two YNN choices.
    The winner (scripted: XLA's ops at 32 tokens) is what the cell runs, stored and loaded back
    with its options; its program calls no kernel while the long cell's does, and both answer
    as the fixed-rule table does. Without the kernel there is nothing to choose between."""
    from jaxserve import kernels
    from jaxserve.polymorph import ATTENTION_OPTION, TUNE_ATTENTION

    short, long = Cell(2, 32), Cell(2, 128)
    xla = {ATTENTION_OPTION: "xla"}

    def tiny(cache_dir, tune):
        cfg = BERT_CONFIGS["bert-tiny-test"]
        sv = bert_servable("bert-tiny-test", cfg, ShapeGrid(batch_sizes=(2,), seq_buckets=(32, 128)))
        return PolymorphTable(sv, CompileCache(cache_dir, False), tune=tune), cfg

    if kernels.attention_impl() != "fused":  # no kernel on this backend or build: one form, no attention choice
        table, _ = tiny(tmp_path / "n", TUNE_ATTENTION)
        assert all(ATTENTION_OPTION not in o for c in (short, long) for o in table.candidates(c))
        return
    table, cfg = tiny(tmp_path / "c", TUNE_ATTENTION)
    plain, _ = tiny(tmp_path / "p", True)
    assert table.candidates(short) == ({}, OFF, xla, {**OFF, **xla})
    assert table.candidates(long) == plain.candidates(long) == ({}, OFF)
    assert plain.candidates(short) == ({}, OFF)
    # a servable without option alternatives still gets both forms, of its fixed rule's options
    no_options = PolymorphTable(dataclasses.replace(table.servable, option_candidates=lambda c: ()), tune=TUNE_ATTENTION)
    assert no_options.candidates(short) == ({}, xla)
    assert table._key(short)[0] != plain._key(short)[0] and table._key(long)[0] == plain._key(long)[0]
    with pytest.raises(ValueError, match="tune must be"):
        tiny(tmp_path / "x", "yes")

    scripted = {32: [0.004, 0.005, 0.002, 0.003], 128: [0.002, 0.003]}

    def best_times(executables, args, **_):
        for ex in executables:
            jax.block_until_ready(ex(*args))
        return scripted[args[1].shape[1]]

    monkeypatch.setattr(polymorph, "_best_times", best_times)
    before = compile_count()
    rows = {r.cell: r for r in table.warmup()}
    assert compile_count() - before == 4 + 2
    assert rows[short.label()].compile_options == xla and rows[long.label()].compile_options == {}
    assert rows[short.label()].tuning_ms == {"default": 4.0, "ynn-off": 5.0, "xla-attn": 2.0, "xla-attn,ynn-off": 3.0}
    kernel_calls = lambda t, c: t.executable(c).as_text().count(kernels.ATTENTION_TARGET)  # noqa: E731
    assert kernel_calls(table, short) == 0 and kernel_calls(table, long) > 0

    weights = weights_of(Bert(cfg, rngs=nnx.Rngs(0)))
    fixed, _ = tiny(tmp_path / "f", False)
    fixed.warmup()
    again, _ = tiny(tmp_path / "c", TUNE_ATTENTION)
    before = compile_count()
    again_rows = {r.cell: r for r in again.warmup()}
    assert compile_count() == before and {r.source for r in again_rows.values()} == {"serialized"}
    assert again_rows[short.label()].compile_options == xla and kernel_calls(again, short) == 0
    rng = np.random.default_rng(2)
    for cell in (short, long):
        ids = rng.integers(1, cfg.vocab_size, (cell.batch, cell.seq)).astype(np.int32)
        mask = np.ones_like(ids)
        mask[1, cell.seq // 2:] = 0  # a padded row: the key bias path too
        ref = fixed.run(cell, weights, ids, mask)["embedding"]
        for t in (table, again):
            np.testing.assert_allclose(t.run(cell, weights, ids, mask)["embedding"], ref, atol=1e-5)
