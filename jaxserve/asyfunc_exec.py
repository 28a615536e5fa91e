"""AsyFunc's split execution (Pei et al., SoCC'23, §3.1, §4.3): a body and its shadow.

A :class:`Body` holds the whole model as stages of one cut: the non-parallel part (``pre``
``[0:i)`` and ``post`` ``[j:L)``, run at the batch ``b``) and the parallel block ``[i:j)``
(run at ``b_B``). A *shadow* is any :class:`~jaxserve.workers.Worker` holding only the block
(a :class:`~jaxserve.workers.ThreadWorker` in this process, or a Ray actor: :class:`PoolWorker`).
:meth:`Body.run` runs ``pre`` on all ``b`` rows, hands rows ``[b_B:b)`` of the block's input to
the shadow, runs rows ``[0:b_B)`` itself meanwhile, merges the two parts back in row order
(:meth:`~jaxserve.stages.Activations.concat`, or the items of a last block) and runs ``post``.
Names follow :mod:`jaxserve.sched.asyfunc` (``b``, ``b_B``, ``b_S = b - b_B``, the block).

Faults: a shadow that dies (its step raises :class:`~jaxserve.workers.WorkerDied`) before or
while its part runs is dropped for this batch: the body computes those rows itself, so the
answer is given once and is what the unsplit model gives. So does a shadow that has not answered
``shadow_timeout_s`` after the body's own part (its late result is dropped). Any other error of
the shadow's step is the batch's error.

Container pool (§3.4): :class:`PoolWorker` is a Ray worker started empty (process up, JAX
imported) that loads one block of any text model on demand, with only that block's parameters
and executables (:func:`load_text_block`: the block's stage table from the node's compile cache,
its slice of the weights), as opposed to a body's actor, which loads and primes the whole model.

Nothing here compiles at request time: every cell a split may use (``b``, ``b_B``, ``b_S``,
each bucketed by the grid) is warmed when the body and the shadow load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from jaxserve.compile_cache import CompileCache
from jaxserve.runtime import ModelRuntime
from jaxserve.sched.base import Cell, Stage
from jaxserve.stages import Activations, StageRuntime, build_stage_runtimes, prime_stage
from jaxserve.workers import Step, StepOutput, Worker, WorkerDied, local_carry

__all__ = ["Body", "PreparedBlock", "SplitTimes", "block_dir", "body_stages", "load_block", "load_image_block",
           "load_text_block", "modelled_seconds", "prepare_block", "prepare_image_block", "prepare_text_block",
           "write_block_checkpoint"]


def body_stages(model: str, num_layers: int, block: Stage) -> tuple[Stage | None, Stage, Stage | None]:
    """(pre, block, post): the stages around ``block`` (None where the block touches an end)."""
    if block.model != model or block.num_layers != num_layers:
        raise ValueError(f"{block.label()} is not a block of {model} ({num_layers} layers)")
    if block.whole:
        raise ValueError(f"{block.label()}: a shadow holds a block, not the whole model")
    pre = None if block.first else Stage(model, 0, block.start, num_layers)
    post = None if block.last else Stage(model, block.stop, num_layers, num_layers)
    return pre, block, post


def modelled_seconds(t_np: float, t_pB: float, t_pS: float, transfer: float) -> float:
    """The paper's Eq. 3 latency: ``max(t_np + t_pB, t_np + t_pS + transfer)``."""
    return max(t_np + t_pB, t_np + t_pS + transfer)


@dataclass(frozen=True)
class SplitTimes:
    """What one split batch took, in seconds on the body's clock: ``t_pre`` + ``t_post`` is
    ``t_np``; ``t_pB`` the body's block part; ``t_pS`` the shadow's compute (its own clock);
    ``shadow_wall`` from handing the rows over to holding the shadow's result, so ``transfer`` =
    ``shadow_wall - t_pS`` (both ways, serialisation and queueing included); ``total`` the whole
    :meth:`Body.run`. ``recomputed``: the shadow died and the body computed its rows."""

    b: int
    b_B: int
    b_S: int
    t_pre: float
    t_pB: float
    t_pS: float
    shadow_wall: float
    t_post: float
    total: float
    recomputed: bool = False

    @property
    def t_np(self) -> float:
        return self.t_pre + self.t_post

    @property
    def transfer(self) -> float:
        return max(0.0, self.shadow_wall - self.t_pS)

    def modelled(self) -> float:
        return modelled_seconds(self.t_np, self.t_pB, self.t_pS, self.transfer)


class Body:
    """The whole model of ``parent`` cut around ``block``: warmed stage runtimes for ``pre``,
    the block and ``post`` (from ``cache``; none compiled later). Runs batches alone or split
    with a shadow worker that holds ``block``."""

    def __init__(self, parent: ModelRuntime, block: Stage, cache: CompileCache | None = None, *, tune: bool | str = False):
        self.parent = parent
        self.pre, self.block, self.post = body_stages(parent.name, parent.num_layers, block)
        stages = [s for s in (self.pre, self.block, self.post) if s is not None]
        self.runners: dict[Stage, StageRuntime] = build_stage_runtimes(parent, stages, cache, tune=tune)

    def cell_for(self, payloads: Sequence[Any]) -> Cell:
        """The non-parallel part's cell for ``payloads`` (token ids): the grid's rule."""
        return self.parent.grid.cell_for(len(payloads), max((len(p) for p in payloads), default=0))

    def _block_input(self, payloads, carry: Activations | None, lo: int, hi: int) -> tuple[tuple, Any]:
        if self.block.first:
            return tuple(payloads[lo:hi]), None
        return (), carry.rows(range(lo, hi))

    def _run_block_here(self, cell: Cell, payloads, tasks, carry, lo: int, hi: int) -> StepOutput:
        rows, part = self._block_input(payloads, carry, lo, hi)
        part_cell = self.parent.grid.cell_for(hi - lo, cell.seq, cell.gamma)
        res = self.runners[self.block].execute(part_cell, list(rows), list(tasks[lo:hi]), part)
        return StepOutput(res.items, res.carry, res.compute_seconds)

    def run(self, payloads: Sequence[Any], tasks: Sequence[str], b_B: int | None = None,
            shadow: Worker | None = None, cell: Cell | None = None,
            shadow_timeout_s: float | None = None) -> tuple[list[dict], SplitTimes]:
        """Answer ``payloads`` (``b`` rows, one ``tasks`` entry each) as the whole model does:
        the block's rows ``[0:b_B)`` here and ``[b_B:b)`` on ``shadow`` (all here when it is
        None or ``b_B == b``). ``cell``: the non-parallel part's (default :meth:`cell_for`).
        ``shadow_timeout_s``: how long to wait for the shadow once the body's part is done
        (None: until it answers or dies); past it the body computes the rows and the shadow's
        late result is dropped."""
        t0 = time.perf_counter()
        b = len(payloads)
        if len(tasks) != b:
            raise ValueError(f"{len(tasks)} tasks for {b} items")
        b_B = b if (b_B is None or shadow is None) else b_B
        if not 0 <= b_B <= b:
            raise ValueError(f"b_B={b_B} is outside [0, {b}]")
        cell = cell or self.cell_for(payloads)
        tasks = list(tasks)
        carry = None
        t_pre = 0.0
        if self.pre is not None:
            res = self.runners[self.pre].execute(cell, list(payloads), tasks)
            carry, t_pre = res.carry, res.compute_seconds
        # the shadow's part goes first, so it runs while the body computes its own
        fut: Future | None = None
        t_handed = time.perf_counter()
        if b_B < b:
            rows, part = self._block_input(payloads, carry, b_B, b)
            try:
                fut = shadow.submit(Step(self.block, self.parent.grid.cell_for(b - b_B, cell.seq, cell.gamma),
                                         rows, tuple(tasks[b_B:]), part))
            except WorkerDied:
                fut = None
            t_handed = time.perf_counter()
        t1 = time.perf_counter()
        mine = self._run_block_here(cell, payloads, tasks, carry, 0, b_B) if b_B else None
        t_pB = time.perf_counter() - t1 if b_B else 0.0
        theirs, t_pS, shadow_wall, recomputed = None, 0.0, 0.0, False
        if b_B < b:
            try:
                if fut is None:
                    raise WorkerDied("the shadow was gone before its part was handed over")
                theirs = fut.result(timeout=shadow_timeout_s)
                shadow_wall, t_pS = time.perf_counter() - t_handed, theirs.compute_seconds
            except (WorkerDied, FuturesTimeout):  # §5.2's coordination, our way: the body does the rows itself
                recomputed = True
                theirs = self._run_block_here(cell, payloads, tasks, carry, b_B, b)
        parts = [p for p in (mine, theirs) if p is not None]
        t2 = time.perf_counter()
        if self.block.last:
            items = [item for p in parts for item in p.items]
            t_post = time.perf_counter() - t2
        else:
            carries = [local_carry(p.carry) for p in parts]  # a Ray shadow's rows wait in the object store
            merged = Activations.concat(carries) if len(carries) > 1 else carries[0]
            res = self.runners[self.post].execute(cell, [], tasks, merged)
            items, t_post = res.items, time.perf_counter() - t2
        return items, SplitTimes(b, b_B, b - b_B, t_pre, t_pB, t_pS, shadow_wall, t_post,
                                 time.perf_counter() - t0, recomputed)


BLOCKS_DIR = "blocks"  # under a compile cache's root: one checkpoint per shadow block and precision
_BLOCK_MODEL = "model.json"  # beside a block's checkpoint: the model's config and tokenizer file


def block_dir(cache_root: str | Path, block: Stage, precision: str = "f32") -> Path:
    """Where ``block``'s own checkpoint lives: ``<cache>/blocks/<precision>/<model>/<i>-<j>-of-<L>``
    (:func:`jaxserve.keys_manager.stage_dir`)."""
    from jaxserve.keys_manager import stage_dir

    return stage_dir(Path(cache_root) / BLOCKS_DIR / precision, block)


def write_block_checkpoint(runner: StageRuntime, cache_root: str | Path, precision: str = "f32") -> tuple[Path, bool]:
    """Save ``runner``'s block parameters (its slice of the weights, at ``precision``) as an orbax
    checkpoint with its digest record (:func:`jaxserve.keys_manager.save_stage_checkpoint`), and
    the model's config and tokenizer file beside it, so a shadow reads this block and nothing
    else (:func:`load_text_block`). Skipped when the recorded digest is already these arrays'
    (then nothing but the digest is computed). Returns (the directory, whether it was written)."""
    from jaxserve.keys_manager import params_digest, params_from_state, recorded_digest, save_stage_checkpoint
    from jaxserve.registry import image_model_config, load_text_model

    block = runner.stage
    directory = block_dir(cache_root, block, precision)
    params = params_from_state(runner.weights)
    if recorded_digest(directory) == params_digest(params) and (directory / _BLOCK_MODEL).exists():
        return directory, False
    if is_image_model(block.model):
        cfg, _ = image_model_config(block.model)
        record = {"config": dataclasses.asdict(cfg), "image": True}
    else:
        cfg, _, tokenizer_json = load_text_model(block.model)  # the config and the tokenizer's path
        record = {"config": dataclasses.asdict(cfg), "tokenizer": str(Path(tokenizer_json).absolute())}
    (directory / _BLOCK_MODEL).unlink(missing_ok=True)
    save_stage_checkpoint(directory, params)
    (directory / _BLOCK_MODEL).write_text(json.dumps(record))
    return directory, True


def is_image_model(model: str) -> bool:
    """Whether ``model`` is one of the registry's image models (its blocks are ViT stages)."""
    from jaxserve.registry import IMAGE_MODELS

    return model in IMAGE_MODELS


@dataclass
class PreparedBlock:
    """What a warm pool worker keeps of a candidate block before any shadow needs it: the
    model's config, the block's warmed (and primed) stage table, and where its tokenizer is.
    Executables take the weights as arguments, so these hold no parameters: a shadow made from
    them only reads the block's parameters (:func:`load_text_block`)."""

    block: Stage
    cfg: Any
    table: Any
    tokenizer_json: str
    parent: Any = None  # an image block's weightless ImageRuntime (registry.image_runtime_shell)


def prepare_text_block(block: Stage, grid, cache: CompileCache | None, *, precision: str = "f32",
                       tune: bool | str = False, prime: bool = True) -> PreparedBlock:
    """``block``'s stage table warmed from ``cache`` (``prime``: every cell run once, on zero
    weights), and the config it needs: from the block's checkpoint record when there is one
    (no array read), else from the whole model."""
    import numpy as np

    from jaxserve.models.bert import BertConfig
    from jaxserve.polymorph import PolymorphTable
    from jaxserve.registry import load_text_model
    from jaxserve.servables import bert_stage_servable
    from jaxserve.stages import prime_table

    if block.whole:
        raise ValueError(f"{block.label()}: a pool worker holds blocks, not whole models")
    meta = _block_meta(cache, block, precision)
    if meta is not None:
        cfg, tokenizer_json = BertConfig(**meta["config"]), meta["tokenizer"]
    else:
        cfg, _, tokenizer_json = load_text_model(block.model)
    if block.num_layers != cfg.num_layers:
        raise ValueError(f"{block.label()} is not a block of {block.model} ({cfg.num_layers} layers)")
    servable = bert_stage_servable(block.model, cfg, grid, block.start, block.stop, precision)
    table = PolymorphTable(servable, cache, tune=tune)
    table.warmup()
    if prime:
        import jax

        zeros = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), servable.abstract_state)
        prime_table(table, zeros)
    return PreparedBlock(block, cfg, table, str(tokenizer_json))


def _block_meta(cache: CompileCache | None, block: Stage, precision: str) -> dict | None:
    """The block checkpoint's model record, if its checkpoint is intact (else None)."""
    from jaxserve.keys_manager import recorded_digest

    if cache is None:
        return None
    directory = block_dir(cache.root, block, precision)
    if recorded_digest(directory) is None or not (directory / _BLOCK_MODEL).exists():
        return None
    return json.loads((directory / _BLOCK_MODEL).read_text())


def load_text_block(model: str, block: Stage, grid, cache: CompileCache | None, *, precision: str = "f32",
                    tune: bool | str = False, prime: bool = True, heads_dir: str | None = None,
                    prepared: PreparedBlock | None = None, params: Any = None) -> StageRuntime:
    """Only ``block`` of the text model ``model``: its stage table (``prepared``'s, else warmed
    from ``cache`` now: :func:`prepare_text_block`) and its parameters; the parent it hangs on
    holds no table and no weights, only what a stage borrows (tokenizer for a first block; for a
    last one the task heads, read from ``heads_dir``, None: the shipped ones, and re-read by its
    ``read_assets`` on a reload). What a pool worker loads (§3.4).

    The parameters are ``params`` when given (the block's arrays as its checkpoint holds them,
    already on the device: what a QUART replica took from its node's parameter cache,
    :mod:`jaxserve.quart_exec`); else they come from the block's own checkpoint in the cache
    (:func:`write_block_checkpoint`, which a server's start writes) when its record is intact:
    only the block's bytes are read. Else the whole model is read and sliced."""
    from jaxserve.keys_manager import load_stage_params, state_from_params
    from jaxserve.models.tokenizer import TextTokenizer
    from jaxserve.registry import load_text_model, text_heads_reader
    from jaxserve.runtime import TextRuntime
    from jaxserve.servables import weights_of
    from jaxserve.stages import slice_stage_weights

    if block.model != model or block.whole:
        raise ValueError(f"{block.label()} is not a block of {model}")
    if prepared is None or prepared.block != block:
        prepared = prepare_text_block(block, grid, cache, precision=precision, tune=tune, prime=prime)
    cfg, table = prepared.cfg, prepared.table
    abstract = table.servable.abstract_state
    if params is not None:
        weights = state_from_params(abstract, params)
    elif _block_meta(cache, block, precision) is not None:
        weights = state_from_params(abstract, load_stage_params(block_dir(cache.root, block, precision)))
    else:
        _, module, _ = load_text_model(model)
        weights = slice_stage_weights(weights_of(module, precision), abstract, block.start)
        del module  # the other layers' arrays go with it: the slice shares only the block's
    read_assets = text_heads_reader(model, None if heads_dir is None else Path(heads_dir), cfg.hidden_size) \
        if block.last else None
    heads = read_assets()[0] if read_assets is not None else {}
    tokenizer = TextTokenizer(prepared.tokenizer_json) if block.first else None
    parent = TextRuntime(model, None, None, heads, num_layers=cfg.num_layers, tokenizer=tokenizer,
                         embedding_dim=cfg.hidden_size, read_assets=read_assets)
    return StageRuntime(block, parent, table, weights)


def prepare_image_block(block: Stage, grid, cache: CompileCache | None, *, precision: str = "f32",
                        tune: bool | str = False, prime: bool = True, prompts_dir: str | None = None) -> PreparedBlock:
    """An image model's ``block``: its stage table (``vit_stage_servable`` over ``grid``, with the
    prompt mode and head width of the model's prompt repository, as the whole model's table is
    keyed) warmed from ``cache`` (``prime``: every cell run once, on zero weights), and the
    model's weightless runtime (:func:`jaxserve.registry.image_runtime_shell`: its tasks' prompts
    and heads, normalisation and image shape), read without the weights."""
    import numpy as np

    from jaxserve.polymorph import PolymorphTable
    from jaxserve.registry import image_runtime_shell
    from jaxserve.servables import vit_stage_servable
    from jaxserve.stages import prime_table

    if block.whole:
        raise ValueError(f"{block.label()}: a pool worker holds blocks, not whole models")
    cfg, parent = image_runtime_shell(block.model, grid, None if prompts_dir is None else Path(prompts_dir))
    if block.num_layers != cfg.num_layers:
        raise ValueError(f"{block.label()} is not a block of {block.model} ({cfg.num_layers} layers)")
    repo = parent.prompts
    servable = vit_stage_servable(block.model, cfg, grid, block.start, block.stop, repo.prompt_mode,
                                  repo.num_classes, precision)
    table = PolymorphTable(servable, cache, tune=tune)
    table.warmup()
    if prime:
        import jax

        zeros = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), servable.abstract_state)
        prime_table(table, zeros)
    return PreparedBlock(block, cfg, table, "", parent)


def load_image_block(model: str, block: Stage, grid, cache: CompileCache | None, *, precision: str = "f32",
                     tune: bool | str = False, prime: bool = True, prompts_dir: str | None = None,
                     prepared: PreparedBlock | None = None, params: Any = None) -> StageRuntime:
    """Only ``block`` of the image model ``model``, as :func:`load_text_block` loads a text
    block: its stage table (``prepared``'s, else :func:`prepare_image_block` now) and its
    parameters (``params``, else the block's checkpoint in the cache when intact, else the whole
    model read and sliced), hung on the model's weightless runtime, which gathers each sample's
    prompts and head (every stage after the first takes them from the carried task names) and
    normalises pixels (the first)."""
    from jaxserve.keys_manager import load_stage_params, state_from_params
    from jaxserve.servables import weights_of
    from jaxserve.stages import slice_stage_weights

    if block.model != model or block.whole:
        raise ValueError(f"{block.label()} is not a block of {model}")
    if prepared is None or prepared.block != block:
        prepared = prepare_image_block(block, grid, cache, precision=precision, tune=tune, prime=prime,
                                       prompts_dir=prompts_dir)
    abstract = prepared.table.servable.abstract_state
    if params is not None:
        weights = state_from_params(abstract, params)
    elif _block_meta(cache, block, precision) is not None:
        weights = state_from_params(abstract, load_stage_params(block_dir(cache.root, block, precision)))
    else:
        from jaxserve.models.vit import load_vit_checkpoint
        from jaxserve.registry import load_dinov2, vit_demo_dir

        module = load_dinov2(prepared.cfg.image_size)[1] if model == "dinov2-s14" else \
            load_vit_checkpoint(vit_demo_dir())[1]
        weights = slice_stage_weights(weights_of(module, precision), abstract, block.start)
        del module
    return StageRuntime(block, prepared.parent, prepared.table, weights)


def prepare_block(block: Stage, spec, cache: CompileCache | None) -> PreparedBlock:
    """:func:`prepare_image_block` or :func:`prepare_text_block`, by the block's model, with a
    worker spec's grids and settings (``jaxserve.ray_workers.WorkerSpec``)."""
    kw = dict(precision=spec.precision, tune=spec.tune, prime=spec.prime)
    if is_image_model(block.model):
        return prepare_image_block(block, spec.image_grid, cache, prompts_dir=spec.prompts_dir, **kw)
    return prepare_text_block(block, spec.text_grid, cache, **kw)


def load_block(block: Stage, spec, cache: CompileCache | None, prepared: PreparedBlock | None = None,
               params: Any = None) -> StageRuntime:
    """:func:`load_image_block` or :func:`load_text_block`, by the block's model, with a worker
    spec's grids, settings and asset directories (heads for MiniLM-L6, as
    ``jaxserve.launch.load_runtimes`` gives them; prompts for image models)."""
    kw = dict(precision=spec.precision, tune=spec.tune, prime=spec.prime, prepared=prepared, params=params)
    if is_image_model(block.model):
        return load_image_block(block.model, block, spec.image_grid, cache, prompts_dir=spec.prompts_dir, **kw)
    heads_dir = spec.heads_dir if block.model == "minilm-l6" else None
    return load_text_block(block.model, block, spec.text_grid, cache, heads_dir=heads_dir, **kw)


# ------------------------------------------------------------------ the container pool, on Ray

try:
    import ray

    from jaxserve.ray_workers import RayWorker, StageHost, WorkerSpec, all_ready
except ImportError:  # pragma: no cover - the ray extra is not installed
    ray = None

if ray is not None:
    class ShadowHost(StageHost):
        """A pool actor: starts empty (JAX imported) and loads blocks of any text model with
        :func:`load_text_block`, never the whole model."""

        def __init__(self, spec: WorkerSpec):
            super().__init__(spec)
            import jax
            import orbax.checkpoint  # noqa: F401  (what reading a block checkpoint imports: 0.3 s)

            jax.devices()  # warm: the imports and the backend a fresh process pays before any load
            self._prepared: dict[Stage, PreparedBlock] = {}

        def prepare(self, blocks: Sequence[Stage]) -> list[str]:
            """Warm the candidate blocks' executables (no parameters) before any shadow needs
            them, as the paper's pool keeps its runtime ready; returns their labels."""
            for block in blocks:
                if block not in self._prepared:
                    self._prepared[block] = prepare_block(block, self._spec, self._open_cache())
            return [b.label() for b in self._prepared]

        def _runner(self, stage: Stage):
            if stage.whole:
                raise ValueError(f"{stage.label()}: a pool worker holds blocks, not whole models")
            return load_block(stage, self._spec, self._open_cache(), self._prepared.get(stage))

        def unload(self, stage: Stage):
            self._runners.pop(stage, None)
            return self.report()

        def reload_assets(self) -> None:
            """Re-read the task heads of every last block held (the only assets a block
            carries), from this node's files: a shadow never answers with stale heads."""
            for runner in self._runners.values():
                if runner.parent.read_assets is not None:
                    runner.parent.swap_assets(*runner.parent.read_assets())

        def pid(self) -> int:
            return os.getpid()

    _ShadowActor = ray.remote(ShadowHost)

    class PoolWorker(RayWorker):
        """The node's warm empty worker (§3.4) as a :class:`RayWorker`: ``ready`` once its
        process is up; :meth:`load` of a block makes it a shadow. ``spec.models`` is not
        consulted: any text model's block loads."""

        kind = "ray-pool"
        actor_class = _ShadowActor

        def kill(self) -> None:
            """End the actor's process now (its steps fail with WorkerDied)."""
            ray.kill(self.actor, no_restart=True)

    class AsyFuncRayWorkers:
        """The workers of a live AsyFunc policy on one Ray node: the bodies it starts with, and
        its ``worker_factory`` (what the engine calls for a planned ``add_worker``).

        The factory asks the policy what instance ``wid`` is (:meth:`AsyFuncPolicy.instance`):
        a **body** is a new :class:`~jaxserve.ray_workers.RayWorker`, started empty; the policy
        then loads the body's stages one by one. A **shadow** is the node's warm pool worker
        (§4.2), handed over as it is (process up and JAX imported, unless two shadows come
        within its start time: then its load waits behind the start), re-numbered ``wid`` and
        re-pinned to its cores; a new pool worker starts at once in its place, so the next
        shadow finds one warm too.

        **Cores.** Every actor is pinned to as many CPU ids as its instance has cores
        (:func:`~jaxserve.ray_workers.pin_process`), the least-used ones of this process's
        affinity first; a body at ``c`` cores is started pinned, so XLA's pool has ``c``
        threads. A pool worker starts pinned to ``pool_cores`` (a shadow's usual share,
        ``c_max // 2``) and is re-pinned when it becomes a shadow. Ray's own CPU accounting is
        bypassed (``num_cpus=0``): the policy accounts cores (its ledger), and Ray would
        otherwise keep an actor pending while the pool worker holds a logical CPU.
        """

        def __init__(self, spec: WorkerSpec, policy: Any, pool_cores: int = 1,
                     cpus: Sequence[int] | None = None):
            self.spec = spec
            self.policy = policy
            self.pool_cores = pool_cores
            self.cpus = tuple(sorted(cpus if cpus is not None else os.sched_getaffinity(0)))
            self._pinned: dict[int, tuple[Any, tuple[int, ...]]] = {}  # worker id -> (worker, cpus)
            self._pool: PoolWorker | None = None
            self.shadows_from_pool = 0

        def _pick(self, cores: int) -> tuple[int, ...]:
            """``cores`` CPU ids, the least used by live pinned workers first (then the lowest)."""
            self._pinned = {k: v for k, v in self._pinned.items() if not v[0].closed}
            use = {c: 0 for c in self.cpus}
            for _, cpus in self._pinned.values():
                for c in cpus:
                    use[c] = use.get(c, 0) + 1
            least = sorted(self.cpus, key=lambda c: (use[c], c))
            return tuple(sorted(least[:max(1, min(cores, len(self.cpus)))]))

        def _worker(self, cls, wid: int, cores: int, stages: Sequence[Stage] = ()):
            cpus = self._pick(cores)
            worker = cls(wid, dataclasses.replace(self.spec, cpus=cpus), stages, num_cpus=0)
            self._pinned[wid] = (worker, cpus)
            return worker

        def bodies(self, stages: Sequence[Stage]) -> list:
            """The policy's initial bodies (ids 0..n-1, every one holding ``stages``), ready,
            and the first pool worker started."""
            out = []
            wid = 0
            while (inst := self.policy.instance(wid)) is not None:
                out.append(self._worker(RayWorker, wid, inst[1], stages))
                wid += 1
            all_ready(out)
            self.refill()
            return out

        def refill(self) -> None:
            """Start a warm pool worker if there is none, and have it prepare the policy's
            candidate blocks (their executables, no parameters: :meth:`ShadowHost.prepare`)."""
            if self._pool is None:
                self._pool = self._worker(PoolWorker, -1, self.pool_cores)
                self._pool.actor.prepare.remote([s.block for s in self.policy.model.splits])

        def __call__(self, wid: int):
            inst = self.policy.instance(wid)
            if inst is None:
                raise RuntimeError(f"worker {wid} is not an instance of the AsyFunc policy")
            kind, cores = inst
            if kind == "body":
                return self._worker(RayWorker, wid, cores)
            self.refill()
            worker, self._pool = self._pool, None
            worker.id = wid
            self._pinned.pop(-1, None)
            cpus = self._pick(cores)
            self._pinned[wid] = (worker, cpus)
            # not awaited (this runs on the engine's loop): an actor runs one caller's calls in
            # order, so the pin precedes the block's load, which the engine plans next
            worker.actor.pin.remote(list(cpus))
            self.shadows_from_pool += 1
            self.refill()
            return worker

        def close(self) -> None:
            """End the pool worker (the engine closes the others)."""
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    __all__ += ["AsyFuncRayWorkers", "PoolWorker", "ShadowHost"]
