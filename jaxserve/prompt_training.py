"""OTAS prompt training: deep prompts and task heads on a frozen ViT (grain -> optax -> orbax).

For every task and every prompt count P (OTAS §III-B: "train each token pair separately")
:func:`train_repository` trains P deep prompts per layer (VPT-deep, inserted before each
block's norm) and the task's linear head, with the backbone frozen: only ``{prompts, head_w,
head_b}`` receive gradients; the backbone weights enter the jitted step as a plain argument.
P = 0 is the head alone (a linear probe), except for the task the backbone was trained on,
whose P = 0 head is the backbone's own. Each P > 0 head starts from the task's P = 0 head, so
training starts from the probe's accuracy instead of from chance. It takes any ViTConfig and
any labelled image splits (ViT-B/16 too); :func:`train_demo` trains the demo ViT's repository
on the digit tasks (jaxserve.datasets), saves it and profiles accuracy per (task, gamma)
through the serving executables (:func:`profile_demo`: ``accuracy.json``, the accuracy half of
the OTAS policies' cost model). ``jaxserve train-prompts`` runs it.

Defaults, measured (bench/RESULTS.md, otas-accuracy): Adam at 3e-2 with cosine decay, batch
32, 30 epochs trains the best prompts at a fixed CPU budget; the paper's SGD at 2e-3 for 50
epochs is far from converged on the demo ViT (``--optimizer sgd --lr 0.002 --epochs 50`` runs
it). Prompt mode 'replace' (VPT-deep: each layer's P prompts replace the previous layer's) is
the default over 'accumulate' (layer i sees i*P prompts): accuracy does not separate them and
accumulate costs up to 1.25x on ViT-B/16 at gamma +8.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from jaxserve.compile_cache import CompileCache
from jaxserve.datasets import DIGIT_TASKS, ImageSplit, digit_task_split, train_batches
from jaxserve.models.vit import ViTConfig, load_vit_checkpoint, vit_forward
from jaxserve.prompts import (
    PromptEntry,
    PromptRepository,
    backbone_head_entry,
    profile_accuracy,
    save_accuracy_profile,
)
from jaxserve.registry import OTAS_GAMMAS, load_image_runtime, vit_demo_dir
from jaxserve.sched.base import ShapeGrid


@dataclass(frozen=True)
class PromptSettings:
    """See the module docstring for why Adam at 3e-2 and not the paper's SGD at 2e-3."""

    epochs: int = 30
    batch_size: int = 32
    learning_rate: float = 3e-2
    optimizer: str = "adam"  # "adam" or "sgd" (momentum 0.9, the paper's recipe with --lr 0.002)
    seed: int = 0


def make_optimizer(settings: PromptSettings, total_steps: int) -> optax.GradientTransformation:
    schedule = optax.cosine_decay_schedule(settings.learning_rate, max(total_steps, 1), alpha=0.01)
    if settings.optimizer == "adam":
        return optax.adam(schedule)
    if settings.optimizer == "sgd":
        return optax.sgd(schedule, momentum=0.9)
    raise ValueError(f"unknown optimizer {settings.optimizer!r}")


def init_prompts(config: ViTConfig, num_prompts: int, seed: int) -> np.ndarray:
    """VPT's initialisation (Jia et al. §3.2): uniform(+-sqrt(6 / (patch_dim + D)))."""
    patch_dim = config.patch_size * config.patch_size * config.num_channels
    bound = float(np.sqrt(6.0 / (patch_dim + config.hidden_size)))
    rng = np.random.default_rng(seed)
    return rng.uniform(-bound, bound, (config.num_layers, num_prompts, config.hidden_size)).astype(np.float32)


def _normalise(images: np.ndarray, mean: float, std: float) -> np.ndarray:
    return ((images - mean) / std).astype(np.float32)


class _Trainer:
    """One jitted train step and one eval function per static prompt count, compiled once and
    shared by every task (jit re-specialises only on a head of another width)."""

    def __init__(self, graphdef, backbone_state, config: ViTConfig, prompt_mode: str):
        self.graphdef, self.state, self.config, self.mode = graphdef, backbone_state, config, prompt_mode
        self._steps: dict = {}
        self._evals: dict = {}

    def logits(self, backbone_state, params, images, num_prompts: int):
        batch = images.shape[0]
        prompts = None
        if num_prompts:
            prompts = jnp.broadcast_to(params["prompts"][None], (batch, *params["prompts"].shape))
        cls = vit_forward(self.graphdef, backbone_state, images, num_prompts=num_prompts,
                          prompt_mode=self.mode, prompts=prompts)["cls"]
        return cls @ params["head_w"] + params["head_b"]

    def _step(self, num_prompts: int, tx: optax.GradientTransformation, key):
        if key not in self._steps:
            @partial(jax.jit, donate_argnums=(1, 2))
            def step(backbone_state, params, opt_state, images, labels):
                def loss_fn(p):
                    logits = self.logits(backbone_state, p, images, num_prompts)
                    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

                loss, grads = jax.value_and_grad(loss_fn)(params)  # params only: the backbone is frozen
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            self._steps[key] = step
        return self._steps[key]

    def fit(self, params: dict, split: ImageSplit, eval_split: ImageSplit, num_prompts: int,
            settings: PromptSettings, desc: str, progress: bool) -> tuple[dict, list[float], float]:
        if len(split) < settings.batch_size:  # batches drop their remainder: nothing would train
            raise ValueError(f"--batch-size {settings.batch_size} exceeds the {len(split)} training images "
                             f"of {desc}; use at most {len(split)}")
        steps = settings.epochs * (len(split) // settings.batch_size)
        tx = make_optimizer(settings, steps)
        step = self._step(num_prompts, tx, (num_prompts, steps, settings))
        # The step donates params: train a copy, so the caller's arrays (e.g. the P = 0 head every
        # P > 0 fit starts from) survive the first step on backends that honour donation (GPU).
        params = jax.tree.map(jnp.copy, params)
        opt_state = tx.init(params)
        losses = []
        bar = tqdm(range(settings.epochs), desc=desc, disable=not progress, leave=False)
        acc = float("nan")
        for epoch in bar:
            epoch_losses = []
            for batch in train_batches(split, settings.batch_size, settings.seed, epoch):
                params, opt_state, loss = step(self.state, params, opt_state, batch["image"], batch["label"])
                epoch_losses.append(float(loss))
            losses.append(float(np.mean(epoch_losses)))
            if epoch == settings.epochs - 1 or epoch % 5 == 4:
                acc = self.accuracy(params, eval_split, num_prompts)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", eval_acc=f"{acc:.3f}")
        return params, losses, acc

    def accuracy(self, params: dict, split: ImageSplit, num_prompts: int) -> float:
        if num_prompts not in self._evals:
            self._evals[num_prompts] = jax.jit(partial(self.logits, num_prompts=num_prompts))
        fn = self._evals[num_prompts]
        correct = 0
        for start in range(0, len(split), 256):
            logits = fn(self.state, params, jnp.asarray(split.images[start:start + 256]))
            correct += int((np.asarray(logits).argmax(-1) == split.labels[start:start + 256]).sum())
        return correct / len(split)


def train_repository(
    config: ViTConfig,
    model: nnx.Module,
    splits: Mapping[str, tuple[ImageSplit, ImageSplit, Sequence[str]]],
    prompt_counts: Sequence[int],
    pixel_mean: float,
    pixel_std: float,
    settings: PromptSettings = PromptSettings(),
    prompt_mode: str = "replace",
    backbone_task: str | None = None,
    progress: bool = True,
) -> PromptRepository:
    """Train every (task, P) entry on a frozen backbone.

    ``splits[task] = (train, eval, labels)`` with images in [0, 1]; ``backbone_task`` names the
    task whose P = 0 head is the backbone's own head (no training). Returns the repository
    (not saved).
    """
    graphdef, state = nnx.split(model)
    trainer = _Trainer(graphdef, state, config, prompt_mode)
    repo = PromptRepository(config.key(), config.num_layers, config.hidden_size, prompt_mode)
    counts = sorted({0, *(int(p) for p in prompt_counts)})
    for task, (train, held, labels) in splits.items():
        train_n = ImageSplit(_normalise(train.images, pixel_mean, pixel_std), train.labels)
        held_n = ImageSplit(_normalise(held.images, pixel_mean, pixel_std), held.labels)
        base = None
        for p in counts:
            t0 = time.perf_counter()
            if p == 0 and task == backbone_task:
                e = backbone_head_entry(model, task)
                params = {"head_w": jnp.asarray(e.head_w), "head_b": jnp.asarray(e.head_b)}
                acc, losses = trainer.accuracy(params, held_n, 0), []
            else:
                params = {
                    "head_w": jnp.zeros((config.hidden_size, len(labels))) if base is None else base["head_w"],
                    "head_b": jnp.zeros((len(labels),)) if base is None else base["head_b"],
                }
                if p:
                    params["prompts"] = jnp.asarray(init_prompts(config, p, settings.seed + p))
                params, losses, acc = trainer.fit(params, train_n, held_n, p, settings, f"{task} P={p}", progress)
            if p == 0:
                base = {"head_w": jnp.asarray(params["head_w"]), "head_b": jnp.asarray(params["head_b"])}
            prompts = None if p == 0 else np.asarray(params["prompts"], np.float32)
            repo.add(PromptEntry(task, p, prompts, np.asarray(params["head_w"], np.float32),
                                 np.asarray(params["head_b"], np.float32), acc), labels)
            if progress:
                tqdm.write(f"{task:>9} P={p}: held-out accuracy {acc:.4f}"
                           + (f"  final loss {losses[-1]:.4f}" if losses else "  (backbone head)")
                           + f"  {time.perf_counter() - t0:.1f}s")
    repo.meta = {"settings": asdict(settings), "prompt_counts": counts}
    return repo


def train_demo(out_dir: str | Path, tasks: Sequence[str] = tuple(DIGIT_TASKS), prompt_counts=(2, 4, 8),
               settings: PromptSettings = PromptSettings(), prompt_mode: str = "replace",
               profile: bool = True, progress: bool = True, cache_dir: str | None = None) -> dict:
    """Train the demo ViT's repository on the digits tasks, save it, and profile accuracy."""
    ckpt = vit_demo_dir()
    meta = json.loads((ckpt / "meta.json").read_text())
    config, model = load_vit_checkpoint(ckpt)
    shape = (config.image_size, config.image_size, config.num_channels)
    splits = {}
    for t in tasks:
        spec = DIGIT_TASKS[t]
        # Progress is evaluated on the profiling split; the test split is only read at the end.
        splits[t] = (digit_task_split(t, "train", shape), digit_task_split(t, "profile", shape), spec.labels)
    norm = meta["normalisation"]
    t0 = time.perf_counter()
    repo = train_repository(config, model, splits, prompt_counts, norm["mean"], norm["std"], settings,
                            prompt_mode, backbone_task="digits", progress=progress)
    repo.meta["train_seconds"] = round(time.perf_counter() - t0, 1)
    repo.save(out_dir)
    result = {"train_seconds": repo.meta["train_seconds"],
              "entries": {f"{t}/P{p}": e.accuracy for (t, p), e in sorted(repo.entries.items())}}
    if profile:
        result.update(profile_demo(out_dir, OTAS_GAMMAS["vit-demo"], progress=progress, cache_dir=cache_dir))
    return result


def profile_demo(prompts_dir: str | Path, gammas: Sequence[int], batch_sizes=(32,), progress: bool = True,
                 cache_dir: str | None = None) -> dict:
    """Accuracy per (task, gamma) through the serving executables, on the profiling split
    (saved as accuracy.json) and the test split (returned for the report)."""
    cache = CompileCache(cache_dir) if cache_dir else None
    rt = load_image_runtime("vit-demo", cache, ShapeGrid(tuple(batch_sizes), gammas=tuple(gammas)),
                            progress=progress, prompts_dir=Path(prompts_dir))
    shape = rt.image_shape
    out = {}
    for split in ("profile", "test"):
        data = {t: digit_task_split(t, split, shape) for t in rt.prompts.tasks}
        out[split] = profile_accuracy(rt, data, gammas, progress=progress)
    save_accuracy_profile(Path(prompts_dir) / "accuracy.json", out["profile"], split="profile (180 held-out images)",
                          prompt_mode=rt.prompts.prompt_mode)
    return {f"{split}_accuracy": {f"{t}/{g}": a for (t, g), a in sorted(p.accuracy.items())} for split, p in out.items()}
