"""Model runtimes: what an executor worker does with one planned batch.

A runtime owns a warmed :class:`~jaxserve.polymorph.PolymorphTable`, the weights and
the task assets of one model: a :class:`TextRuntime` takes token ids, an
:class:`ImageRuntime` images. ``execute`` pads the batch into its cell (through the
table's padding helpers), runs the executable and returns one result per item. It
never compiles: a cell outside the warmed grid raises ``NotWarmError``.

Image runtimes with a prompt repository (OTAS, jaxserve/prompts.py) run exactly the cell
the policy chose, gamma included: :meth:`ImageRuntime.prepare_inputs` gathers each
sample's prompts (gamma > 0) and task head from the repository, so a batch mixing tasks
is one call of one executable; each item's probabilities are then read from the first
``len(labels)`` logits of its row (heads are zero-padded to the widest task).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from jaxserve.cascade import CascadeText, next_inputs, tokenizer_for
from jaxserve.polymorph import PolymorphTable, pad_image_batch, pad_token_batch, unpad_rows
from jaxserve.sched.base import AccuracyProfile, Cell, ShapeGrid


@dataclass(frozen=True)
class TaskHead:
    """A linear classification head: ``softmax((features @ weight + bias) / temperature)``.

    With ``weight`` None the executable already produced the logits (a model's own
    head, e.g. the demo ViT's digit classifier) and only the softmax is applied.
    ``temperature`` (> 0, finite; 1.0 = none) is the head's calibration, fitted by its
    training script (temperature scaling on a validation split); it never changes the
    argmax, only how confident the probabilities are. Files saved before it existed load
    with 1.0.
    """

    name: str
    labels: tuple[str, ...]
    weight: np.ndarray | None  # [features, classes]
    bias: np.ndarray | None  # [classes]
    feature: str = "embedding"  # which executable output it reads
    accuracy: float | None = None  # held-out accuracy reported by its training script
    temperature: float = 1.0  # logits are divided by it before the softmax (calibration)

    def __post_init__(self) -> None:
        """A head that could fail, or answer garbage, while a batch runs is refused here,
        when it is loaded (at startup, or by a reload, which then changes nothing): heads
        are applied to every item of a mixed batch, so one bad head would fail the requests
        of every task and the plain embeddings batched with it."""
        if not self.labels or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"head {self.name!r}: labels must be distinct and at least one")
        if self.feature not in ("embedding", "logits"):
            raise ValueError(f"head {self.name!r}: feature {self.feature!r} is not 'embedding' or 'logits'")
        if not (np.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"head {self.name!r}: temperature {self.temperature!r} is not a positive finite number")
        if (self.weight is None) != (self.bias is None) or (self.weight is None) != (self.feature == "logits"):
            raise ValueError(f"head {self.name!r}: a weight and bias over the embedding, or neither over logits")
        if self.weight is None:
            return
        if self.weight.ndim != 2 or self.bias.shape != (self.weight.shape[1],):
            raise ValueError(f"head {self.name!r}: weight {self.weight.shape} and bias {self.bias.shape} "
                             "do not make a [features, classes] linear layer")
        if len(self.labels) > self.weight.shape[1]:
            raise ValueError(f"head {self.name!r}: {len(self.labels)} labels for {self.weight.shape[1]} classes")
        if not (np.isfinite(self.weight).all() and np.isfinite(self.bias).all()):
            raise ValueError(f"head {self.name!r}: weight or bias holds NaN or infinity")

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        logits = features if self.weight is None else features @ self.weight + self.bias
        logits = logits[..., : len(self.labels)]  # per-sample heads are padded to the widest task
        if self.temperature != 1.0:
            logits = logits / np.float32(self.temperature)
        logits = logits - logits.max(axis=-1, keepdims=True)
        e = np.exp(logits)
        return e / e.sum(axis=-1, keepdims=True)

    def save(self, path: str | Path) -> None:
        np.savez(
            path, labels=np.array(self.labels), weight=self.weight, bias=self.bias,
            feature=np.array(self.feature), accuracy=np.array(-1.0 if self.accuracy is None else self.accuracy),
            temperature=np.array(float(self.temperature)),
        )

    @classmethod
    def load(cls, name: str, path: str | Path) -> "TaskHead":
        """The head saved at ``path``; ValueError naming the file if it is not a valid one.
        A file without a ``temperature`` array (saved before it existed) loads with 1.0."""
        try:
            with np.load(path) as z:
                acc = float(z["accuracy"])
                temperature = float(z["temperature"]) if "temperature" in z.files else 1.0
                return cls(name, tuple(str(x) for x in z["labels"]), z["weight"].astype(np.float32),
                           z["bias"].astype(np.float32), str(z["feature"]), None if acc < 0 else acc,
                           temperature)
        except Exception as exc:  # not an npz, a missing array, a wrong shape or dtype, a bad head
            raise ValueError(f"{path}: not a usable task head ({type(exc).__name__}: {exc})") from None


@dataclass
class BatchOutput:
    items: list[dict[str, Any]]
    compute_seconds: float


@dataclass
class ModelRuntime(ABC):
    """One served model: its warmed table, weights and task assets.

    A subclass says what an item is by how it pads a batch into a cell
    (:class:`TextRuntime`: token ids; :class:`ImageRuntime`: an image); everything else,
    the task assets and ``execute``, is shared. The task assets are ``heads`` (applied
    after the executable), ``prompts`` (per-sample executable arguments gathered by task:
    an image model's prompt repository; None where tasks are heads only) and ``accuracy``
    (profiled per (task, gamma), for the OTAS policies); :meth:`swap_assets` replaces them
    together.
    """

    name: str
    table: PolymorphTable
    weights: Any
    heads: dict[str, TaskHead] = field(default_factory=dict)
    prompts: Any = None  # jaxserve.prompts.PromptRepository
    accuracy: AccuracyProfile | None = None
    num_layers: int = 0  # the model's depth: its whole-model Stage is [0:num_layers] (jaxserve.sched.base.Stage)
    # re-reads (heads, prompts, accuracy) from where they were loaded, checked against this
    # runtime's executables (jaxserve.registry sets it); None: the assets cannot be reloaded
    read_assets: Callable[[], tuple[dict, Any, Any]] | None = field(default=None, repr=False)
    _assets_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def swap_assets(self, heads: dict[str, TaskHead], prompts: Any = None, accuracy: Any = None) -> list[str]:
        """Serve new task heads (and, for images, a new prompt repository) from the next batch
        on, with the executables as they are: heads are applied after the executable and
        prompts are its arguments, so nothing compiles. A batch already running finishes
        with the assets it started with (``execute`` reads them once, under the same lock).

        Tasks can be added and updated, never removed: requests for a task may already be
        queued, and each must still be answered. Returns the added task names."""
        self.check_assets(heads, prompts)
        with self._assets_lock:
            added = sorted(set(heads) - set(self.heads))
            self.heads, self.prompts, self.accuracy = dict(heads), prompts, accuracy
        return added

    def check_assets(self, heads: dict[str, TaskHead], prompts: Any = None) -> None:
        """Raise ValueError if :meth:`swap_assets` would refuse these."""
        gone = sorted(set(self.heads) - set(heads))
        if gone:
            raise ValueError(f"{self.name}: a reload cannot remove tasks {gone} (requests for them may be "
                             "queued); restart the server to drop a task")
        if (prompts is None) != (self.prompts is None):
            raise ValueError(f"{self.name}: a reload cannot add or drop the prompt repository")

    def _assets(self) -> tuple[dict[str, TaskHead], Any]:
        with self._assets_lock:
            return self.heads, self.prompts

    @property
    def grid(self) -> ShapeGrid:
        return self.table.servable.grid

    @staticmethod
    def _tasks_or_default(tasks: Sequence[str], prompts: Any) -> list[str]:
        """With a prompt repository, an item without a task is served as its first task."""
        if prompts is None:
            return list(tasks)
        default = next(iter(prompts.labels), "")
        return [t or default for t in tasks]

    @abstractmethod
    def prepare_inputs(self, cell: Cell, payloads: Sequence[Any], tasks: Sequence[str], prompts: Any = None) -> tuple:
        """The executable's inputs after the weights, for ``payloads`` padded into ``cell``
        (``prompts``: the repository to gather from; default: the runtime's current one)."""

    @abstractmethod
    def example_inputs(self, cell: Cell) -> tuple:
        """Representative inputs of ``cell``, as :meth:`prepare_inputs` returns them, for
        timing it (profiling, the first run before ready): a full batch of full-size items."""

    def execute(self, cell: Cell, payloads: Sequence[Any], tasks: Sequence[str]) -> BatchOutput:
        t0 = time.perf_counter()
        heads, prompts = self._assets()  # one consistent set for the whole batch (swap_assets)
        tasks = self._tasks_or_default(tasks, prompts)
        inputs = self.prepare_inputs(cell, payloads, tasks, prompts)
        outputs = unpad_rows(self.table.run(cell, self.weights, *inputs), len(payloads))
        return BatchOutput(self.items_from_outputs(outputs, tasks, heads), time.perf_counter() - t0)

    def items_from_outputs(self, outputs: dict[str, np.ndarray], tasks: Sequence[str],
                           heads: dict[str, TaskHead]) -> list[dict]:
        """One answer per real row: the row of every output, plus, for a row with a task, its
        head's ``probabilities``, ``labels`` and ``label``. ``outputs`` hold exactly
        ``len(tasks)`` rows (padding sliced off); ``heads`` are those the batch runs with (a
        reload may swap the runtime's meanwhile)."""
        items = []
        for i, task in enumerate(tasks):
            item = {k: v[i] for k, v in outputs.items()}
            if task:
                head = heads[task]
                probs = head.probabilities(item[head.feature][None])[0]
                item["probabilities"] = probs
                item["labels"] = head.labels
                item["label"] = head.labels[int(np.argmax(probs))]
            items.append(item)
        return items


@dataclass(kw_only=True)
class TextRuntime(ModelRuntime):
    """A text encoder: an item is a list of token ids, padded into the cell's length bucket."""

    tokenizer: Any = None  # jaxserve.models.tokenizer.TextTokenizer; None: ids are padded with 0
    embedding_dim: int | None = None  # width of the sentence embedding

    def prepare_inputs(self, cell: Cell, payloads: Sequence[Any], tasks: Sequence[str], prompts: Any = None) -> tuple:
        """(ids, mask), each [cell.batch, cell.seq]; tasks are heads only, applied afterwards.
        A payload is token ids or a cascade level's :class:`~jaxserve.cascade.CascadeText`."""
        ids = [p.ids if isinstance(p, CascadeText) else p for p in payloads]
        return pad_token_batch(ids, cell, pad_id=0 if self.tokenizer is None else self.tokenizer.pad_id)

    def execute(self, cell: Cell, payloads: Sequence[Any], tasks: Sequence[str]) -> BatchOutput:
        """As :meth:`ModelRuntime.execute`; a cascade level's item also gets ``_next``, the
        inputs of the models after it (pruned by the executable's ``_importance`` output
        where it has one and the payload an alpha: jaxserve.cascade), and ``pruned_tokens``."""
        out = super().execute(cell, payloads, tasks)
        for item, p in zip(out.items, payloads):
            if isinstance(p, CascadeText) and p.next_models:
                item["_next"], item["pruned_tokens"] = next_inputs(p, item.get("_importance"), self.tokenizer,
                                                                   tokenizer_for)
        return out

    def example_inputs(self, cell: Cell) -> tuple:
        return self.prepare_inputs(cell, [[1000] * cell.seq] * cell.batch, [""] * cell.batch)


MAX_IMAGE_SIDE = 1024  # pixels a side of an image a resizing runtime accepts (ImageRuntime.resizes)


@dataclass(kw_only=True)
class ImageRuntime(ModelRuntime):
    """An image classifier: an item is a float32 [H, W, C] image in [0, 1], normalised as the
    model was trained, with each sample's prompts and head gathered from the repository."""

    image_shape: tuple[int, int, int]  # (H, W, C)
    # images arrive in [0, 1]; the model was trained on (x - mean) / std, a scalar or one per channel [C]
    pixel_mean: float | np.ndarray = 0.0
    pixel_std: float | np.ndarray = 1.0
    # True: the server takes an image of another size (up to MAX_IMAGE_SIDE a side, gray or as many
    # channels as the model) and resizes it as the tasks were trained (jaxserve.datasets.resize_image);
    # False: only image_shape is accepted (the demo ViT's tasks were upsampled from 8x8 digits)
    resizes: bool = False

    def prepare_inputs(self, cell: Cell, payloads: Sequence[Any], tasks: Sequence[str], prompts: Any = None) -> tuple:
        """(pixels, [prompts,] head_w, head_b): the images padded into the cell and each
        sample's task arguments at the cell's gamma (``PromptRepository.gather``)."""
        images = (np.stack(payloads) - self.pixel_mean) / self.pixel_std
        pixels = pad_image_batch(images, cell)
        prompts = prompts if prompts is not None else self.prompts
        if prompts is None:
            raise ValueError(f"{self.name}: image executables take per-sample heads; give the runtime a prompt "
                             "repository (jaxserve.prompts.backbone_repository serves the backbone's own head)")
        return (pixels, *prompts.gather(self._tasks_or_default(tasks, prompts), cell.gamma, cell.batch))

    def example_inputs(self, cell: Cell) -> tuple:
        """Random images, each gathered as the repository's first task."""
        images = np.random.default_rng(0).random((cell.batch, *self.image_shape), dtype=np.float32)
        return self.prepare_inputs(cell, list(images), [""] * cell.batch)
