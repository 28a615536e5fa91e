"""The OTAS prompt repository and accuracy profiling per (task, gamma).

Prompt repository (OTAS §III-A "task register", §III-B). A task is registered with one
:class:`PromptEntry` per prompt count P: deep prompts ``[layers, P, D]`` (none for P = 0)
and the linear head ``(head_w [D, C], head_b [C])`` trained together with them (VPT trains
prompts and head jointly; a head trained on un-prompted features is not the right head for
prompted features, so the head is keyed by (task, P) too). At serving time a batch runs one
executable ``Cell(batch, 0, gamma)``:

* gamma > 0 gathers each sample's ``(task, P=gamma)`` prompts and head;
* gamma <= 0 gathers each sample's ``(task, P=0)`` head: ToMe merging needs no training
  (ToMe §4; OTAS Fig. 4 applies it to the trained model as is), so every merge level shares
  the task's un-prompted head.

:meth:`PromptRepository.gather` stacks those per-sample arrays for a whole (possibly
mixed-task) batch, so one executable serves every task; prompts and heads are executable
arguments, never baked constants. Heads of tasks with fewer classes than the widest task are
zero-padded to ``num_classes`` columns; the runtime reads only the first ``len(labels)``
logits of each row, so the padding never reaches an answer.

Storage: ``<dir>/state`` is an orbax checkpoint of ``{task: {"p<P>": {prompts, head_w,
head_b}}}`` and ``<dir>/repository.json`` holds the labels, the backbone's config key (a
repository trained on another backbone is refused), the prompt mode and training metadata.
``<dir>/accuracy.json`` is the accuracy profile per (task, gamma) written by
:func:`profile_accuracy` (the policy's cost model reads it).

The tasks the demo repository is trained on, and the splits its accuracy is profiled on,
are the digit tasks of :mod:`jaxserve.datasets`.

Benchmark-only tasks (:data:`BENCHMARK_ONLY_LICENCES`: data whose licence forbids shipping it, or
anything trained on it, with the package) may be held by a repository, but
:meth:`PromptRepository.save` refuses to write such a repository inside the installed ``jaxserve``
package (``jaxserve/assets/...``), so a probe trained on them can never be bundled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping, Optional, Sequence

import numpy as np
from tqdm import tqdm

from jaxserve.orbax_io import restore_here
from jaxserve.sched.base import AccuracyProfile

if TYPE_CHECKING:  # jaxserve.datasets imports the registry, which imports this module
    from jaxserve.datasets import ImageSplit

__all__ = [
    "BENCHMARK_ONLY_LICENCES", "PromptEntry", "PromptRepository", "backbone_head_entry", "backbone_repository",
    "load_accuracy_profile", "profile_accuracy", "refuse_bundling", "save_accuracy_profile",
]


# ----------------------------------------------------------------------------------- repository

# Tasks whose data may be used for benchmarks only, with their licence: a repository holding one is
# never saved inside the package (PromptRepository.save). elpv (datasets.DINOV2_BENCH_TASKS): the
# solar-cell images of PyPI elpv-dataset, licensed CC-BY-NC-SA 4.0 (non-commercial, share-alike).
BENCHMARK_ONLY_LICENCES: dict[str, str] = {"elpv": "CC-BY-NC-SA-4.0"}
PACKAGE_DIR = Path(__file__).resolve().parent  # the installed jaxserve package


def refuse_bundling(tasks: Iterable[str], directory: str | Path) -> None:
    """ValueError if any of ``tasks`` is benchmark-only (:data:`BENCHMARK_ONLY_LICENCES`) and
    ``directory`` lies inside the installed jaxserve package (symlinks resolved), naming the task,
    its licence and the path; otherwise nothing."""
    bench_only = [t for t in tasks if t in BENCHMARK_ONLY_LICENCES]
    if not bench_only:
        return
    target = Path(directory).expanduser().resolve()
    if target == PACKAGE_DIR or PACKAGE_DIR in target.parents:
        task = bench_only[0]
        raise ValueError(f"task {task!r} is benchmark-only (licence {BENCHMARK_ONLY_LICENCES[task]}): a repository "
                         f"holding it may not be saved inside the jaxserve package, and {target} is; save it under "
                         "compiled_cache/ or a temporary directory")


@dataclass(frozen=True)
class PromptEntry:
    """One (task, prompt count) pair of the repository."""

    task: str
    num_prompts: int
    prompts: Optional[np.ndarray]  # [layers, P, D]; None when P = 0
    head_w: np.ndarray  # [D, C_task]
    head_b: np.ndarray  # [C_task]
    accuracy: Optional[float] = None  # held-out accuracy measured by the training script

    def __post_init__(self) -> None:
        if self.num_prompts < 0:
            raise ValueError("num_prompts must be >= 0")
        if (self.prompts is None) != (self.num_prompts == 0):
            raise ValueError("prompts must be given exactly when num_prompts > 0")
        if self.prompts is not None and self.prompts.shape[1] != self.num_prompts:
            raise ValueError(f"prompts {self.prompts.shape} do not hold {self.num_prompts} prompts per layer")
        if self.head_w.shape[1] != self.head_b.shape[0]:
            raise ValueError("head_w and head_b disagree on the class count")


@dataclass
class PromptRepository:
    """Prompts and heads keyed by (task, prompt count), for one backbone."""

    config_key: str  # the backbone's ViTConfig.key(): a repository only fits its backbone
    num_layers: int
    hidden_size: int
    prompt_mode: str = "replace"
    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    entries: dict[tuple[str, int], PromptEntry] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prompt_mode not in ("replace", "accumulate"):
            raise ValueError(f"prompt_mode must be 'replace' or 'accumulate', got {self.prompt_mode!r}")
        self._stacks: dict[int, tuple] = {}

    # -------------------------------------------------------------- contents
    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.labels)

    @property
    def num_classes(self) -> int:
        """Head width of the executables: the widest task's class count."""
        return max(len(v) for v in self.labels.values())

    def prompt_counts(self, task: str) -> tuple[int, ...]:
        return tuple(sorted(p for (t, p) in self.entries if t == task))

    def add(self, entry: PromptEntry, labels: Sequence[str]) -> None:
        labels = tuple(labels)
        if self.labels.setdefault(entry.task, labels) != labels:
            raise ValueError(f"task {entry.task!r} is registered with labels {self.labels[entry.task]}")
        if entry.head_w.shape != (self.hidden_size, len(labels)):
            raise ValueError(f"head of {entry.task!r} is {entry.head_w.shape}, expected {(self.hidden_size, len(labels))}")
        if entry.prompts is not None and entry.prompts.shape != (self.num_layers, entry.num_prompts, self.hidden_size):
            raise ValueError(f"prompts of {entry.task!r} are {entry.prompts.shape}")
        self.entries[(entry.task, entry.num_prompts)] = entry
        self._stacks.clear()

    def entry(self, task: str, gamma: int) -> PromptEntry:
        """The entry an executable at ``gamma`` uses for ``task``: P = max(gamma, 0)."""
        key = (task, max(int(gamma), 0))
        if key not in self.entries:
            raise KeyError(f"no prompts for task {task!r} with {key[1]} prompts; have {self.prompt_counts(task)}")
        return self.entries[key]

    def missing_for(self, gammas: Iterable[int]) -> list[tuple[str, int]]:
        """(task, P) pairs a grid with these gammas needs but the repository lacks."""
        need = {max(int(g), 0) for g in gammas}
        return [(t, p) for t in self.tasks for p in sorted(need) if (t, p) not in self.entries]

    # -------------------------------------------------------------- serving
    def _stack(self, num_prompts: int) -> tuple:
        """Per prompt count: task index, prompts [T, L, P, D] (or None), heads [T, D, C], [T, C]."""
        if num_prompts not in self._stacks:
            tasks, C = self.tasks, self.num_classes
            w = np.zeros((len(tasks), self.hidden_size, C), np.float32)
            b = np.zeros((len(tasks), C), np.float32)
            prompts = (np.zeros((len(tasks), self.num_layers, num_prompts, self.hidden_size), np.float32)
                       if num_prompts else None)
            for i, t in enumerate(tasks):
                e = self.entry(t, num_prompts)
                w[i, :, : e.head_w.shape[1]] = e.head_w
                b[i, : e.head_b.shape[0]] = e.head_b
                if prompts is not None:
                    prompts[i] = e.prompts
            self._stacks[num_prompts] = ({t: i for i, t in enumerate(tasks)}, prompts, w, b)
        return self._stacks[num_prompts]

    def gather(self, tasks: Sequence[str], gamma: int, batch: int) -> tuple[np.ndarray, ...]:
        """The per-sample arguments of executable ``Cell(batch, 0, gamma)`` after the pixels:
        ``(prompts [B, L, P, D], head_w [B, D, C], head_b [B, C])`` for gamma > 0, else
        ``(head_w, head_b)``. Rows past ``len(tasks)`` (batch padding) reuse the first task's
        parameters: their outputs are sliced away, and real arrays keep the padding rows
        numerically ordinary."""
        if len(tasks) > batch:
            raise ValueError(f"{len(tasks)} samples do not fit batch {batch}")
        index, prompts, w, b = self._stack(max(int(gamma), 0))
        try:
            rows = np.array([index[t] for t in tasks] + [0] * (batch - len(tasks)), dtype=np.int64)
        except KeyError as exc:
            raise KeyError(f"unknown task {exc.args[0]!r}; tasks: {list(self.tasks)}") from None
        heads = (np.take(w, rows, axis=0), np.take(b, rows, axis=0))
        return heads if prompts is None else (np.take(prompts, rows, axis=0), *heads)

    # -------------------------------------------------------------- storage
    def save(self, directory: str | Path) -> None:
        """Write the repository to ``directory`` (created; its ``state`` and ``repository.json``
        replaced). ValueError, before anything is written, when it holds a benchmark-only task and
        ``directory`` is inside the jaxserve package (:func:`refuse_bundling`)."""
        refuse_bundling(self.tasks, directory)
        import orbax.checkpoint as ocp  # 0.4 s of import that only writing needs (and the CLI imports this module)

        out = Path(directory).absolute()
        out.mkdir(parents=True, exist_ok=True)
        tree: dict = {}
        for (task, p), e in sorted(self.entries.items()):
            leaf = {"head_w": np.asarray(e.head_w, np.float32), "head_b": np.asarray(e.head_b, np.float32)}
            if e.prompts is not None:
                leaf["prompts"] = np.asarray(e.prompts, np.float32)
            tree.setdefault(task, {})[f"p{p}"] = leaf
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(out / "state", tree, force=True)
        meta = {
            "config_key": self.config_key, "num_layers": self.num_layers, "hidden_size": self.hidden_size,
            "prompt_mode": self.prompt_mode, "labels": {t: list(v) for t, v in self.labels.items()},
            "entries": [{"task": t, "num_prompts": p, "accuracy": e.accuracy}
                        for (t, p), e in sorted(self.entries.items())],
            **self.meta,
        }
        (out / "repository.json").write_text(json.dumps(meta, indent=1) + "\n")

    @classmethod
    def load(cls, directory: str | Path, config_key: Optional[str] = None) -> "PromptRepository":
        """Read a repository; with ``config_key`` refuse one trained on another backbone."""
        path = Path(directory).absolute()
        meta = json.loads((path / "repository.json").read_text())
        if config_key is not None and meta["config_key"] != config_key:
            raise ValueError(f"{path} was trained on another backbone (config key {meta['config_key'][:12]}..., "
                             f"expected {config_key[:12]}...)")
        tree = restore_here(path / "state")
        extra = {k: v for k, v in meta.items()
                 if k not in ("config_key", "num_layers", "hidden_size", "prompt_mode", "labels", "entries")}
        repo = cls(meta["config_key"], meta["num_layers"], meta["hidden_size"], meta["prompt_mode"], meta=extra)
        accuracy = {(row["task"], row["num_prompts"]): row["accuracy"] for row in meta["entries"]}
        for task, labels in meta["labels"].items():
            for key, leaf in tree[task].items():
                p = int(key[1:])
                prompts = leaf.get("prompts")
                repo.add(PromptEntry(task, p, None if prompts is None else np.asarray(prompts, np.float32),
                                     np.asarray(leaf["head_w"], np.float32), np.asarray(leaf["head_b"], np.float32),
                                     accuracy.get((task, p))), labels)
        return repo


def backbone_head_entry(model, task: str) -> PromptEntry:
    """The P = 0 entry of the task a backbone was trained on: its own classification head."""
    return PromptEntry(task, 0, None, np.asarray(model.head.kernel[...], np.float32),
                       np.asarray(model.head.bias[...], np.float32))


def backbone_repository(config, model, task: str, labels: Sequence[str]) -> PromptRepository:
    """A repository holding only the backbone's own head (no prompts): what serving falls back
    to when no trained repository exists, so gamma <= 0 cells still serve that task."""
    repo = PromptRepository(config.key(), config.num_layers, config.hidden_size)
    repo.add(backbone_head_entry(model, task), labels)
    return repo


# ------------------------------------------------------------------------------ accuracy profile


def profile_accuracy(runtime, splits: Mapping[str, ImageSplit], gammas: Optional[Iterable[int]] = None,
                     progress: bool = False) -> AccuracyProfile:
    """Accuracy per (task, gamma) of a warmed image runtime on labelled splits.

    Runs the very executables that serve (``runtime.execute``, one task per call, in chunks
    of the largest compiled batch), so the profile describes exactly what the policy will
    run; nothing compiles. ``gammas`` defaults to every gamma of the runtime's grid.
    """
    grid = runtime.grid
    gammas = tuple(gammas) if gammas is not None else grid.gammas
    jobs = [(t, g) for t in splits for g in gammas]
    it = jobs
    if progress:
        it = tqdm(jobs, desc=f"accuracy {runtime.name}", unit="(task,gamma)")
    accuracy = {}
    step = grid.max_batch
    for task, gamma in it:
        split = splits[task]
        labels = runtime.heads[task].labels
        correct = 0
        for start in range(0, len(split), step):
            images = split.images[start:start + step]
            cell = grid.cell_for(len(images), 0, gamma)
            out = runtime.execute(cell, list(images), [task] * len(images))
            predicted = [labels.index(item["label"]) for item in out.items]
            correct += int(np.sum(np.asarray(predicted) == split.labels[start:start + step]))
        accuracy[(task, int(gamma))] = correct / len(split)
    return AccuracyProfile(runtime.name, accuracy)


def save_accuracy_profile(path: str | Path, profile: AccuracyProfile, **meta) -> None:
    rows = [[t, g, a] for (t, g), a in sorted(profile.accuracy.items())]
    Path(path).write_text(json.dumps({"model": profile.model, **meta, "accuracy": rows}, indent=1) + "\n")


def load_accuracy_profile(path: str | Path, model: Optional[str] = None) -> AccuracyProfile:
    raw = json.loads(Path(path).read_text())
    return AccuracyProfile(model or raw["model"], {(str(t), int(g)): float(a) for t, g, a in raw["accuracy"]})
