"""The polymorph table: one ahead-of-time compiled executable per cell of a shape grid.

A :class:`Servable` declares, as data, what a model serves: its grid of cells
(:class:`~jaxserve.sched.base.ShapeGrid`), the pure function each cell compiles and the
abstract shapes of its arguments. :class:`PolymorphTable` compiles (or loads) every
cell at warmup and afterwards only looks cells up: asking for a cell that was not
warmed is an error, never a compile, so nothing compiles at request time.

Padding into a cell and slicing out of it live here and only here. The cell for an
input comes from :meth:`ShapeGrid.cell_for` — the one bucketing rule that warmup,
serving and every policy share.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxserve.compile_cache import (
    CompileCache,
    ManifestRow,
    entry_key,
    environment_fingerprint,
    install_compile_counter,
    serialized,
)
from jaxserve.sched.base import Cell, ShapeGrid

log = logging.getLogger("jaxserve.polymorph")


def ynn_off(when: bool, platform: str | None = None, keep: tuple[str, ...] = ()) -> dict[str, str]:
    """The XLA option that keeps YNNPACK out of an executable, where ``when`` and on the CPU.

    XLA:CPU (jax 0.10) hands dots and the element-wise work around them to YNNPACK as
    "YNN fusions". For small calls that wins; for large ones the plain XLA emitters are
    faster, and where the crossover lies depends on the model (each servable's
    ``options_of`` states its rule). ``keep``: YNN fusion
    kinds to leave on (``"INDIVIDUAL_DOT"``: single dots, nothing fused around them).
    Other backends: {}.
    """
    platform = platform or jax.default_backend()
    if not when or platform != "cpu":
        return {}
    return {YNN_OPTION: ",".join(f"{_YNN_KIND}{k}" for k in keep)}


YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"
_YNN_KIND = "LIBRARY_FUSION_TYPE_"
# Not an XLA option: how the cell's attention is traced. {ATTENTION_OPTION: "xla"} traces it as
# XLA ops instead of the fused CPU kernel (jaxserve.kernels); a candidate of warmup's attention
# tuning (PolymorphTable, tune="attention"). Stripped before XLA sees the options; kept in the
# cache key and the manifest like theirs.
ATTENTION_OPTION = "attention"
TUNE_ATTENTION = "attention"  # PolymorphTable(tune=...): time the attention forms too


class NotWarmError(KeyError):
    """A cell was asked for that warmup did not compile; serving never compiles."""


@dataclass(frozen=True)
class Servable:
    """What a model serves, declared as data.

    ``fn_for(cell)`` returns the pure function compiled for ``cell``: its first
    argument is the weights pytree, the rest are the cell's inputs, whose abstract
    shapes ``input_specs(cell)`` gives. ``variant_of(cell)`` names the static settings
    baked into that function (e.g. the OTAS gamma), so the cache keys them too.
    """

    name: str
    config_hash: str
    grid: ShapeGrid
    abstract_state: Any
    fn_for: Callable[[Cell], Callable]
    input_specs: Callable[[Cell], tuple[jax.ShapeDtypeStruct, ...]]
    variant_of: Callable[[Cell], str] = lambda cell: ""
    # XLA compiler options per cell (part of the cache key): e.g. polymorph.ynn_off. The
    # fixed rule, used where a table does not tune (or the servable offers no alternatives)
    options_of: Callable[[Cell], dict[str, str]] = lambda cell: {}
    # alternatives a tuning table times at warmup, keeping the fastest on this machine: for
    # options whose best choice depends on the CPU, not only on the model and the shape
    option_candidates: Callable[[Cell], tuple[dict[str, str], ...]] = lambda cell: ()
    # cells where attention tuning (PolymorphTable, tune="attention") also times attention as
    # XLA ops against the fused kernel (each option candidate both ways)
    attention_alternative: Callable[[Cell], bool] = lambda cell: False
    precision: str = "f32"  # dense-kernel dtype (jaxserve.models.precision); part of the cache key
    # stage_servable(start, stop): the servable of layers [start, stop) of this model over the
    # same grid (jaxserve.stages), named and keyed by its range; None: the model cannot be cut
    stage_servable: Callable[[int, int], "Servable"] | None = None

    def abstract_args(self, cell: Cell) -> tuple:
        return (self.abstract_state, *self.input_specs(cell))


@dataclass
class CellStats:
    source: str = ""
    compile_seconds: float = 0.0
    compile_options: dict = field(default_factory=dict)  # what the cell's executable was compiled with


def options_label(options: dict[str, str]) -> str:
    """A short name for a set of compile options: "default" for none, "ynn-off" or
    "ynn-only:individual_dot" for :func:`ynn_off`'s."""
    parts = []
    for k, v in sorted(options.items()):
        if k == ATTENTION_OPTION:
            parts.append(f"{v}-attn")
        elif k == YNN_OPTION:
            parts.append("ynn-only:" + v.replace(_YNN_KIND, "").lower() if v else "ynn-off")
        else:
            parts.append(f"{k}={v}")
    return ",".join(parts) or "default"


class PolymorphTable:
    """Compiled executables for every cell of one servable's grid.

    ``tune`` (default): where the servable offers alternative compile options for a cell
    (``Servable.option_candidates``), warmup compiles each, times it on this machine and keeps
    the fastest. Why measure instead of a rule: which XLA:CPU options win depends on the
    machine (YNNPACK's fusions won at small cells on the Xeon the fixed rule was fitted on and
    lost on an EPYC; measurements: bench/RESULTS.md, 'The measurements behind the code's
    rules'). A rule is right for the machine it was fitted on; a measurement is right
    where it runs. The cache key names the candidates, not the winner; the entry stores the
    winner, so later starts load it without timing again, and the manifest row says which
    options won and every candidate's time. Timing runs each candidate on stand-in weights
    and inputs (:meth:`_timing_args`, freed when :meth:`warmup` ends), interleaved, and
    keeps each one's best time. The option alternatives are compilations of the same program,
    so the choice changes speed, never results beyond float rounding.

    ``tune="attention"`` (opt-in: ``--tune-attention``) also times, where the servable allows
    (``Servable.attention_alternative``) and the fused kernel is in use, each candidate with
    attention traced as XLA ops: the kernel wins at most cells, XLA's ops at some of the
    smallest (bench/RESULTS.md, ``peer``: the ``ours/xla-attn`` column). It doubles those cells'
    compiles, which is why it is not the default. The two forms are two programs with the same
    results to float rounding (tests/integration/test_attention.py).
    """

    def __init__(self, servable: Servable, cache: CompileCache | None = None, tune: bool | str = True):
        if tune not in (False, True, TUNE_ATTENTION):
            raise ValueError(f"tune must be False, True or {TUNE_ATTENTION!r}, got {tune!r}")
        install_compile_counter()
        self.servable = servable
        self.cache = cache
        self.tune = tune
        self._executables: dict[Cell, Any] = {}
        self.stats: dict[Cell, CellStats] = {}
        self._out_trees: dict[str, Any] = {}
        self._timing_state = None  # the weights warmup's timing runs with, made once per table

    def candidates(self, cell: Cell) -> tuple[dict[str, str], ...]:
        """The compile options warmup chooses between for ``cell``: more than one only where
        this table tunes and the servable's alternatives differ on this backend."""
        if self.tune:
            unique: list[dict[str, str]] = []
            for options in self.servable.option_candidates(cell):
                if options not in unique:
                    unique.append(options)
            if self._tunes_attention(cell):  # each option choice (or the fixed rule's) in both forms
                unique = unique or [self.servable.options_of(cell)]
                unique += [dict(o, **{ATTENTION_OPTION: "xla"}) for o in unique]
            if len(unique) > 1:
                return tuple(unique)
        return (self.servable.options_of(cell),)

    def _tunes_attention(self, cell: Cell) -> bool:
        from jaxserve import kernels

        return (self.tune == TUNE_ATTENTION and self.servable.attention_alternative(cell)
                and kernels.attention_impl() == "fused")

    # ------------------------------------------------------------------ warmup
    def keys(self) -> set[str]:
        """The cache keys of every cell of the grid, as this process would store them."""
        return {self._key(cell)[0] for cell in self.servable.grid.cells()}

    def _key(self, cell: Cell) -> tuple[str, dict]:
        s = self.servable
        args = s.abstract_args(cell)
        avals = [(str(p), tuple(x.shape), str(x.dtype)) for p, x in jax.tree_util.tree_leaves_with_path(args)]
        parts = {
            "model": s.name,
            "config": s.config_hash,
            "cell": cell.label(),
            "variant": s.variant_of(cell),
            "compile_options": self._key_options(cell),
            "precision": s.precision,
            "avals": avals,
            "env": environment_fingerprint(),
        }
        return entry_key(parts), parts

    def _key_options(self, cell: Cell) -> dict:
        candidates = self.candidates(cell)
        return candidates[0] if len(candidates) == 1 else {"tuned": list(candidates)}

    def _trees(self, cell: Cell):
        """in/out pytree structures for deserialisation; the output structure depends only
        on the function variant, so it is traced once per variant, not once per cell."""
        s = self.servable
        args = s.abstract_args(cell)
        in_tree = jax.tree_util.tree_structure((args, {}))
        variant = s.variant_of(cell)
        if variant not in self._out_trees:
            out = jax.eval_shape(s.fn_for(cell), *args)
            self._out_trees[variant] = jax.tree_util.tree_structure(out)
        return in_tree, self._out_trees[variant]

    def warm_cell(self, cell: Cell) -> ManifestRow:
        s = self.servable
        key, parts = self._key(cell)
        candidates = self.candidates(cell)
        t0 = time.perf_counter()
        compiled = None
        source = "compiled"
        options, tuning_ms = candidates[0], {}
        if self.cache is not None:
            n_events = len(self.cache.events)
            compiled = self.cache.load(key, *self._trees(cell))
            if compiled is not None:
                source = "serialized"
                stored = self.cache.description(key)
                options, tuning_ms = stored.get("chosen_options", options), stored.get("tuning_ms", {})
            elif len(self.cache.events) > n_events:
                source = "rebuilt"
        if compiled is None:
            if len(candidates) == 1:
                compiled, how = self._compile(key, self._lower(cell, options), parts, options, store=True)
            else:
                compiled, how, options, tuning_ms = self._tune(cell, key, parts, candidates)
            if how == "xla-cache" or source != "rebuilt":
                source = how
        seconds = time.perf_counter() - t0
        self._executables[cell] = compiled
        self.stats[cell] = CellStats(source, seconds, options)
        env = parts["env"]
        return ManifestRow(
            model=s.name, config_hash=s.config_hash, cell=cell.label(), key=key,
            jax=env["jax"], jaxlib=env["jaxlib"], xla_flags=env["xla_flags"],
            compile_seconds=round(seconds, 4), source=source, compile_options=options,
            precision=s.precision, host_cpu=env["host_cpu"], tuning_ms=tuning_ms,
        )

    def _lower(self, cell: Cell, options: dict):
        """``cell``'s program, lowered; with ``{ATTENTION_OPTION: "xla"}``, attention as XLA ops."""
        fn, args = self.servable.fn_for(cell), self.servable.abstract_args(cell)
        if options.get(ATTENTION_OPTION) != "xla":
            return jax.jit(fn).lower(*args)
        from jaxserve import kernels

        def traced(*a):  # a function jax has not traced: no cached trace of the fused form comes back
            return fn(*a)

        with kernels.tracing_xla_attention():
            return jax.jit(traced).lower(*args)

    def _compile(self, key: str, lowered, parts: dict, options: dict, store: bool) -> tuple[Any, str]:
        xla = {k: v for k, v in options.items() if k != ATTENTION_OPTION}
        if self.cache is None:
            return lowered.compile(compiler_options=xla or None), "compiled"
        return self.cache.compile(key, lowered, parts, options=xla, store=store)

    def _tune(self, cell: Cell, key: str, parts: dict, candidates) -> tuple[Any, str, dict, dict]:
        """Compile every candidate (lowered once per attention form), time each, keep (and
        store) the fastest. Returns (executable, where it came from, its options, best ms per
        candidate)."""
        lowered: dict[Any, Any] = {}
        built = []
        for options in candidates:
            form = options.get(ATTENTION_OPTION)
            if form not in lowered:
                lowered[form] = self._lower(cell, options)
            built.append(self._compile(key, lowered[form], parts, options, store=False))
        # serialized before timing runs them (compile_cache.serialized); an XLA-cache load never is
        payloads = [serialized(c) if self.cache is not None and how == "compiled" else None for c, how in built]
        best = _best_times([b[0] for b in built], self._timing_args(cell))
        winner = min(range(len(candidates)), key=best.__getitem__)
        compiled, how = built[winner]
        tuning_ms = {options_label(o): round(t * 1e3, 3) for o, t in zip(candidates, best)}
        if payloads[winner] is not None:
            self.cache.store_payload(key, payloads[winner],
                                     dict(parts, chosen_options=candidates[winner], tuning_ms=tuning_ms))
        log.info("%s %s: %s (%s)", self.servable.name, cell.label(), options_label(candidates[winner]),
                 ", ".join(f"{k} {v:.2f} ms" for k, v in tuning_ms.items()))
        return compiled, how, candidates[winner], tuning_ms

    def _timing_args(self, cell: Cell) -> tuple:
        """Stand-in weights (made once per table, on the device, with no compile) and inputs
        for ``cell``: small random floats, integers all ones (a valid token id, a full mask).

        Not zeros: a large ``np.zeros`` may be backed by the kernel's one shared zero page
        until written, which real weights are not; these stand-ins time as real weights do
        (measurements: bench/RESULTS.md, 'The measurements behind the code's rules')."""
        rng = np.random.default_rng(0)

        def fill(a):
            if np.issubdtype(a.dtype, np.integer):
                return np.ones(a.shape, a.dtype)
            return (rng.standard_normal(a.shape, np.float32) * 0.02).astype(a.dtype)

        if self._timing_state is None:
            self._timing_state = jax.tree_util.tree_map(lambda a: jax.device_put(fill(a)), self.servable.abstract_state)
        return (self._timing_state, *(fill(a) for a in self.servable.input_specs(cell)))

    def warmup(self, cells: Sequence[Cell] | None = None, progress: bool = False,
               stop: Callable[[], bool] | None = None) -> list[ManifestRow]:
        """Compile or load every cell (default: the whole grid); write the manifest.
        ``stop``: asked before each cell; True raises :class:`WarmupCancelled` (a server told
        to shut down while it warms exits within one cell's compile, not the whole grid's)."""
        cells = list(cells if cells is not None else self.servable.grid.cells())
        it = cells
        if progress:
            from tqdm import tqdm

            it = tqdm(cells, desc=f"warmup {self.servable.name}", unit="cell")
        rows = []
        for cell in it:
            raise_if_stopped(stop)
            rows.append(self.warm_cell(cell))
            if progress:
                it.set_postfix_str(f"{cell.label()} {rows[-1].source} {rows[-1].compile_seconds:.2f}s")
        self._timing_state = None  # stand-in weights, as large as the model's: not kept once warm
        if self.cache is not None:
            self.cache.write_manifest(rows)
        return rows

    @property
    def warm(self) -> bool:
        return all(c in self._executables for c in self.servable.grid.cells())

    # ----------------------------------------------------------------- serving
    def executable(self, cell: Cell):
        try:
            return self._executables[cell]
        except KeyError:
            raise NotWarmError(f"{self.servable.name}: cell {cell.label()} was not compiled at warmup") from None

    def run(self, cell: Cell, state, *inputs) -> dict[str, np.ndarray]:
        """Run one executable; outputs come back as host numpy arrays (blocking)."""
        out = self.executable(cell)(state, *inputs)
        return jax.tree_util.tree_map(np.asarray, out)


def _best_times(executables: Sequence[Any], args: tuple, rounds: int = 2, min_seconds: float = 0.02) -> list[float]:
    """Each executable's best seconds per call over ``rounds`` interleaved rounds (each round
    repeats calls for at least ``min_seconds``). The minimum discounts a first call's
    one-time costs, and with the interleaving keeps another tenant's burst from deciding.
    Two rounds: more would only settle near ties, where the choice costs little either way,
    and warmup pays for every call (``bench/coldstart.py``)."""
    best = [float("inf")] * len(executables)
    for _ in range(rounds):
        for i, ex in enumerate(executables):
            calls, t0 = 0, time.perf_counter()
            while True:
                jax.block_until_ready(ex(*args))
                calls += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= min_seconds:
                    break
            best[i] = min(best[i], elapsed / calls)
    return best


class WarmupCancelled(Exception):
    """Start-up was told to stop (the server is shutting down before it was ready)."""


def raise_if_stopped(stop: Callable[[], bool] | None) -> None:
    """The check every per-cell start-up loop (compile, profile, first run) makes per cell."""
    if stop is not None and stop():
        raise WarmupCancelled("start-up stopped: the server is shutting down")


# ---------------------------------------------------------------- text padding

def pad_token_batch(token_ids: Sequence[Sequence[int]], cell: Cell, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of shape [cell.batch, cell.seq]; unused rows are all padding.

    Raises if the inputs don't fit the cell: fitting is decided by ``cell_for``.
    """
    if len(token_ids) > cell.batch:
        raise ValueError(f"{len(token_ids)} inputs do not fit batch {cell.batch}")
    ids = np.full((cell.batch, cell.seq), pad_id, dtype=np.int32)
    mask = np.zeros((cell.batch, cell.seq), dtype=np.int32)
    for row, seq in enumerate(token_ids):
        if len(seq) > cell.seq:
            raise ValueError(f"input of {len(seq)} tokens does not fit bucket {cell.seq}")
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


def unpad_rows(outputs: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """Drop the padding rows a cell's batch dimension added."""
    return {k: v[:count] for k, v in outputs.items()}


def pad_image_batch(images: np.ndarray, cell: Cell) -> np.ndarray:
    """Images [n, H, W, C] zero-padded along the batch to ``cell.batch`` rows."""
    n = images.shape[0]
    if n > cell.batch:
        raise ValueError(f"{n} images do not fit batch {cell.batch}")
    if n == cell.batch:
        return np.ascontiguousarray(images, dtype=np.float32)
    out = np.zeros((cell.batch, *images.shape[1:]), dtype=np.float32)
    out[:n] = images
    return out


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    cell: Cell
    compute_seconds: float
    extras: dict = field(default_factory=dict)
