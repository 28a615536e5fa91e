"""Stage executables: a model cut into contiguous layer ranges, each its own servable.

A :class:`~jaxserve.sched.base.Stage` ``[start, stop)`` of an L-layer model runs the
embeddings (first stage), its layers, and the pooling and head (last stage); the whole model
is the one-stage case ``[0, L)``. Each stage has its own polymorph table over the whole
model's grid (``Servable.stage_servable``: ``bert_stage_servable`` / ``vit_stage_servable``),
whose cache keys name the range, and holds only its own parameters, sliced from the whole
model's (:func:`slice_stage_weights`).

Between stages travel :class:`Activations`: the hidden states and what the next layers need
besides (BERT: the mask; ViT: the ToMe token sizes where gamma merges), padded to the
producing cell. A stage after the first must run the same sequence bucket / gamma as its
predecessor (the token count entering a ViT stage is fixed by gamma and the layer); its batch
may differ, as long as the real rows fit. Inside one process the hidden states stay device
arrays; :meth:`Activations.rows` and :meth:`Activations.concat` gather rows on the host to
re-batch requests between stages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxserve.compile_cache import CompileCache
from jaxserve.polymorph import PolymorphTable, raise_if_stopped, unpad_rows
from jaxserve.runtime import ImageRuntime, ModelRuntime, TextRuntime
from jaxserve.sched.base import Cell, Stage

__all__ = ["Activations", "Stage", "StageResult", "StageRuntime", "build_stage_runtimes", "slice_stage_weights",
           "split_stages"]


def split_stages(model: str, num_layers: int, boundaries: Sequence[int]) -> tuple[Stage, ...]:
    """The stages of ``model`` cut before each layer in ``boundaries``: ``(3,)`` of 6 layers is
    ``[0:3], [3:6]``; ``()`` is the whole model. ValueError unless the boundaries are integers,
    strictly increasing, and inside (0, num_layers)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) or num_layers < 1:
        raise ValueError(f"{model}: num_layers must be a positive integer, got {num_layers!r}")
    cuts = list(boundaries)
    for b in cuts:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise ValueError(f"{model}: stage boundaries must be layer indices (integers), got {b!r}")
        if not 0 < b < num_layers:
            raise ValueError(f"{model}: stage boundary {b} is outside (0, {num_layers}): every stage needs at "
                             f"least one layer of the {num_layers}")
    if any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"{model}: stage boundaries must be strictly increasing, got {tuple(cuts)}")
    edges = [0, *(int(b) for b in cuts), int(num_layers)]
    return tuple(Stage(model, a, b, int(num_layers)) for a, b in zip(edges, edges[1:]))


@dataclass
class Activations:
    """What one stage hands the next: batched arrays whose leading axis is the batch, padded
    to the producing cell (rows past ``count`` are padding). Text: ``hidden`` [B, S, H]
    float32 and ``mask`` [B, S] int32; images: ``hidden`` [B, N, D] and, where gamma merges,
    ``size`` [B, N]. Arrays may be device arrays (one process) or numpy (between processes).
    A pytree (``arrays`` the children, ``count`` static), so ``jax.tree_util.tree_map``
    converts them."""

    arrays: dict[str, Any]
    count: int

    def rows(self, idx: Sequence[int]) -> "Activations":
        """The real rows ``idx`` (in that order), gathered on the host, unpadded."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.count):
            raise IndexError(f"rows {idx.tolist()} are not among the {self.count} real rows")
        return Activations({k: np.asarray(v)[idx] for k, v in self.arrays.items()}, int(idx.size))

    @staticmethod
    def concat(parts: Sequence["Activations"]) -> "Activations":
        """The real rows of ``parts``, one after another (host arrays, unpadded)."""
        if not parts:
            raise ValueError("nothing to concatenate")
        keys = set(parts[0].arrays)
        if any(set(p.arrays) != keys for p in parts):
            raise ValueError(f"activations of different kinds: {[sorted(p.arrays) for p in parts]}")
        arrays = {k: np.concatenate([np.asarray(p.arrays[k])[: p.count] for p in parts]) for k in parts[0].arrays}
        return Activations(arrays, sum(p.count for p in parts))

    def nbytes(self) -> int:
        """Bytes of the arrays, padding rows included (what a transfer moves)."""
        return int(sum(np.dtype(v.dtype).itemsize * int(np.prod(v.shape)) for v in self.arrays.values()))


jax.tree_util.register_pytree_node(
    Activations,
    lambda a: ((a.arrays,), a.count),
    lambda count, children: Activations(children[0], count),
)


@dataclass
class StageResult:
    """A stage step's result: ``items`` (last stage: one dict per real item, as
    ``ModelRuntime.execute`` answers) or ``carry`` (the activations for the next stage);
    ``compute_seconds`` from inputs to outputs ready, on this host's clock."""

    items: list[dict] | None
    carry: Activations | None
    compute_seconds: float


@dataclass
class StageRuntime:
    """One stage of a served model: its warmed table and only its own weights.

    ``parent`` (the whole-model runtime) lends its input preparation (tokens or pixels), its
    task assets (heads, prompt repository) and its answers' format; a whole-model stage is
    the parent itself (its table and weights, nothing compiled twice). Never compiles: a
    cell outside the warmed grid raises ``NotWarmError``."""

    stage: Stage
    parent: ModelRuntime
    table: PolymorphTable
    weights: Any

    @property
    def grid(self):
        return self.table.servable.grid

    def param_bytes(self) -> int:
        """Bytes of this stage's parameters."""
        return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(self.weights)))

    def execute(self, cell: Cell, payloads: Sequence, tasks: Sequence[str],
                carry: Activations | None = None) -> StageResult:
        """Run ``cell`` of this stage: on ``payloads`` (first stage: token ids or images, as
        ``ModelRuntime.execute`` takes them) or on ``carry`` (a later stage: the previous
        stage's activations, ``len(tasks) == carry.count`` real rows, the same sequence
        bucket / gamma). ``tasks``: one per real row (heads apply in the last stage, prompts
        in every stage of an image model at gamma > 0)."""
        t0 = time.perf_counter()
        parent, stage = self.parent, self.stage
        if stage.whole:
            out = parent.execute(cell, payloads, tasks)
            return StageResult(out.items, None, time.perf_counter() - t0)
        heads, prompts = parent._assets()  # one consistent set for the whole batch (swap_assets)
        tasks = parent._tasks_or_default(tasks, prompts)
        if stage.first:
            if carry is not None:
                raise ValueError(f"{stage.label()} is a first stage: it takes payloads, not activations")
            count = len(payloads)
        else:
            if carry is None:
                raise ValueError(f"{stage.label()} takes the activations of the stage before it")
            count = carry.count
        if len(tasks) != count:
            raise ValueError(f"{stage.label()}: {len(tasks)} tasks for {count} items")
        if isinstance(parent, TextRuntime):
            args, passed_on = self._text_args(cell, payloads, tasks, prompts, carry)
        elif isinstance(parent, ImageRuntime):
            args, passed_on = self._image_args(cell, payloads, tasks, prompts, carry)
        else:
            raise TypeError(f"no stage inputs for a {type(parent).__name__}")
        self._check_shapes(cell, args)
        if stage.last:
            outputs = unpad_rows(self.table.run(cell, self.weights, *args), count)
            return StageResult(parent.items_from_outputs(outputs, tasks, heads), None, time.perf_counter() - t0)
        out = jax.block_until_ready(self.table.executable(cell)(self.weights, *args))
        return StageResult(None, Activations({**out, **passed_on}, count), time.perf_counter() - t0)

    # ------------------------------------------------------------------ inputs
    def _text_args(self, cell, payloads, tasks, prompts, carry) -> tuple[tuple, dict]:
        """(ids or hidden, mask); the mask travels on unchanged."""
        if self.stage.first:
            ids, mask = self.parent.prepare_inputs(cell, payloads, tasks, prompts)
            return (ids, mask), {"mask": mask}
        arrays = _fit_rows(carry, cell.batch)
        return (arrays["hidden"], arrays["mask"]), {"mask": arrays["mask"]}

    def _image_args(self, cell, payloads, tasks, prompts, carry) -> tuple[tuple, dict]:
        """(pixels or hidden[, size][, this stage's prompts][, head_w, head_b]), in the order
        ``vit_stage_servable`` declares; the task arguments are gathered as the whole model's."""
        if self.stage.first:
            x, *task_args = self.parent.prepare_inputs(cell, payloads, tasks, prompts)
            carried = ()
        else:
            if prompts is None:  # as ImageRuntime.prepare_inputs refuses it
                raise ValueError(f"{self.parent.name}: image executables take per-sample heads; give the runtime "
                                 "a prompt repository")
            task_args = list(prompts.gather(tasks, cell.gamma, cell.batch))
            arrays = _fit_rows(carry, cell.batch)
            x, carried = arrays["hidden"], ((arrays["size"],) if "size" in arrays else ())
        if cell.gamma > 0:  # [B, L, P, D] -> this stage's layers
            task_args[0] = task_args[0][:, self.stage.start:self.stage.stop]
            task_args = task_args if self.stage.last else task_args[:1]
        elif not self.stage.last:
            task_args = []
        return (x, *carried, *task_args), {}

    def _check_shapes(self, cell: Cell, args: tuple) -> None:
        """A clear error where the inputs do not fit the cell (the caller's guarantee)."""
        specs = self.table.servable.input_specs(cell)
        got = [tuple(np.shape(a)) for a in args]
        want = [tuple(s.shape) for s in specs]
        if got != want:
            raise ValueError(f"{self.stage.label()} {cell.label()}: inputs of shapes {got} do not fit the cell's "
                             f"{want} (activations must come from a cell of the same sequence bucket / gamma)")


def _fit_rows(carry: Activations, batch: int) -> dict[str, Any]:
    """``carry``'s arrays with exactly ``batch`` rows: as they are if they have that many (a
    batch handed on whole stays on the device), else its real rows padded by repeating the
    first (numerically ordinary rows, sliced away afterwards)."""
    if carry.count > batch:
        raise ValueError(f"{carry.count} rows of activations do not fit batch {batch}")
    out = {}
    for k, v in carry.arrays.items():
        if v.shape[0] == batch:
            out[k] = v
            continue
        real = np.asarray(v)[: carry.count]
        pad = np.repeat(real[:1], batch - carry.count, axis=0)
        out[k] = np.concatenate([real, pad])
    return out


def slice_stage_weights(weights: Any, stage_abstract: Any, start: int) -> Any:
    """The parameters of a stage, taken from the whole model's ``weights`` (an ``nnx.split``
    state) by path: a stage's path ``(list, j, ...)`` (an integer second part: a layer of the
    model's layer list) is the model's layer ``start + j``; every other path is the model's
    own (embeddings, final norm, head). ``stage_abstract``: the stage servable's abstract
    state, whose tree, shapes and dtypes the result has. The arrays are shared, not copied."""
    flat = dict(nnx.to_flat_state(weights))
    pairs = []
    for path, abstract in nnx.to_flat_state(stage_abstract):
        source = path
        if len(path) > 1 and isinstance(path[1], int):
            source = (path[0], path[1] + start, *path[2:])
        if source not in flat:
            raise KeyError(f"the model has no parameter {'/'.join(map(str, source))}")
        variable = flat[source]
        value, want = variable.get_value(), abstract.get_value()
        if tuple(value.shape) != tuple(want.shape) or np.dtype(value.dtype) != np.dtype(want.dtype):
            raise ValueError(f"{'/'.join(map(str, source))}: {value.dtype}{list(value.shape)} where the stage "
                             f"takes {want.dtype}{list(want.shape)}")
        pairs.append((path, variable))
    return nnx.from_flat_state(pairs)


def build_stage_runtimes(parent: ModelRuntime, stages: Sequence[Stage], cache: CompileCache | None, *,
                         progress: bool = False, tune: bool | str = False,
                         stop: Callable[[], bool] | None = None) -> dict[Stage, StageRuntime]:
    """A warmed :class:`StageRuntime` per stage of ``parent``'s model: each compiles (or loads
    from ``cache``) every cell of the parent's grid, keyed by its range, and holds its slice
    of the parent's weights. ``progress``, ``tune`` and ``stop`` as ``PolymorphTable``'s; a
    node's warmup must tune (or not) as its loader does to share entries. ValueError for a
    stage of another model or depth, or a model that cannot be cut."""
    out: dict[Stage, StageRuntime] = {}
    for stage in stages:
        if stage.model != parent.name or stage.num_layers != parent.num_layers:
            raise ValueError(f"{stage.label()} of {stage.num_layers} layers is not a stage of {parent.name} "
                             f"({parent.num_layers} layers)")
        if stage.whole:
            out[stage] = StageRuntime(stage, parent, parent.table, parent.weights)
            continue
        make = parent.table.servable.stage_servable
        if make is None:
            raise ValueError(f"{parent.name}: its servable cannot be cut into stages")
        servable = make(stage.start, stage.stop)
        table = PolymorphTable(servable, cache, tune=tune)
        table.warmup(progress=progress, stop=stop)
        weights = slice_stage_weights(parent.weights, servable.abstract_state, stage.start)
        out[stage] = StageRuntime(stage, parent, table, weights)
    return out


def prime_stage(runner: StageRuntime, stop: Callable[[], bool] | None = None) -> None:
    """Run every cell of ``runner``'s table once on its weights (:func:`prime_table`)."""
    prime_table(runner.table, runner.weights, stop)


def prime_table(table: PolymorphTable, weights: Any, stop: Callable[[], bool] | None = None) -> None:
    """Run every cell of ``table`` once with ``weights`` on placeholder inputs (ones for integer
    inputs, 0.02 elsewhere), so the first real steps do not pay the executables' one-time
    costs; ``stop`` is asked before each cell (``raise_if_stopped``)."""
    servable = table.servable
    for cell in servable.grid.cells():
        raise_if_stopped(stop)
        args = [np.ones(s.shape, s.dtype) if np.issubdtype(s.dtype, np.integer) else np.full(s.shape, 0.02, s.dtype)
                for s in servable.input_specs(cell)]
        jax.block_until_ready(table.executable(cell)(weights, *args))
