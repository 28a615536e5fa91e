"""OTAS accuracy against gamma on the demo ViT's three tasks, and what prompt training bought.

    nice -n 10 python -m bench.otas_accuracy [--accumulate-dir DIR] [--write]

Reads the shipped prompt repository (jaxserve/assets/vit-demo-prompts: trained by
``jaxserve train-prompts``) and measures, through the serving executables (one per gamma at
batch 32), accuracy per (task, gamma) on the held-out profiling split (what the policy plans
with; the same numbers as accuracy.json) and on the held-out test split (which nothing was
tuned on). With ``--accumulate-dir`` (a repository trained with ``--mode accumulate``) it
puts the two prompt modes side by side on accuracy.
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/otas_accuracy.py", "jaxserve/prompts.py", "jaxserve/assets/vit-demo-prompts", "jaxserve/models",
    "jaxserve/kernels", "jaxserve/polymorph.py", "jaxserve/servables.py", "jaxserve/compile_cache.py",
    "jaxserve/runtime.py",
)
SECTIONS = {"otas-accuracy": "--write"}

import argparse
import json
from pathlib import Path

from bench.common import add_quick, apply_quick, PLOTS, record, save_plot, table

# The optimiser comparison behind jaxserve/prompt_training.py's defaults: the same code
# (train_repository, task "inverted", P = 4), profiling-split accuracy of (P = 0 probe, P = 4).
OPTIMISER_SWEEP = [
    ("SGD m=0.9, lr 0.002, 50 epochs (the paper's recipe)", 0.6056, 0.6722),
    ("SGD m=0.9, lr 0.1, 30 epochs", 0.7222, 0.7389),
    ("Adam, lr 0.01, 10 epochs", 0.6556, 0.6944),
    ("Adam, lr 0.1, 30 epochs", 0.7167, 0.7333),
    ("Adam, lr 0.03, 30 epochs (default)", 0.7000, 0.7611),
]


def measure(prompts_dir: Path, gammas, cache_dir):
    from jaxserve.compile_cache import CompileCache
    from jaxserve.datasets import digit_task_split
    from jaxserve.prompts import profile_accuracy
    from jaxserve.registry import load_image_runtime
    from jaxserve.sched.base import ShapeGrid

    rt = load_image_runtime("vit-demo", CompileCache(cache_dir) if cache_dir else None,
                            ShapeGrid((32,), gammas=tuple(gammas)), prompts_dir=prompts_dir)
    out = {}
    for split in ("profile", "test"):
        data = {t: digit_task_split(t, split, rt.image_shape) for t in rt.prompts.tasks}
        out[split] = profile_accuracy(rt, data, gammas)
    return rt.prompts, out


def plot(profiles: dict, gammas, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    test = profiles["test"]
    for task in sorted({t for t, _ in test.accuracy}):
        ax.plot(gammas, [test.of(task, g) for g in gammas], marker="o", label=f"{task} (test)")
        ax.plot(gammas, [profiles["profile"].of(task, g) for g in gammas], ls=":", color=ax.lines[-1].get_color())
    ax.set_xlabel("gamma (< 0: ToMe merges per layer, > 0: prompts per layer)")
    ax.set_ylabel("accuracy")
    ax.set_title("demo ViT: accuracy vs gamma (solid test, dotted profiling split)")
    save_plot(fig, ax, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts-dir", default=None)
    p.add_argument("--accumulate-dir", default=None)
    p.add_argument("--cache-dir", default="compiled_cache")
    p.add_argument("--write", action="store_true")
    add_quick(p, accumulate_dir=None)
    args = apply_quick(p.parse_args())
    from jaxserve.registry import OTAS_GAMMAS, vit_demo_prompts_dir

    gammas = OTAS_GAMMAS["vit-demo"]
    prompts_dir = Path(args.prompts_dir) if args.prompts_dir else vit_demo_prompts_dir()
    repo, profiles = measure(prompts_dir, gammas, args.cache_dir)
    tasks = list(repo.tasks)
    body = "Accuracy by task and gamma, held-out **test** split (profiling split in brackets):\n\n" + table(
        ["task"] + [f"{g:+d}" for g in gammas],
        [[t] + [f"{profiles['test'].of(t, g):.3f} ({profiles['profile'].of(t, g):.3f})" for g in gammas]
         for t in tasks])
    mean = lambda split, g: sum(profiles[split].of(t, g) for t in tasks) / len(tasks)
    body += "\n\n" + table(["mean over tasks"] + [f"{g:+d}" for g in gammas],
                           [["test"] + [f"{mean('test', g):.3f}" for g in gammas],
                            ["profile"] + [f"{mean('profile', g):.3f}" for g in gammas]])
    settings = repo.meta.get("settings", {})
    body += ("\n\nPrompt training (frozen backbone; profiling-split accuracy after training, per (task, P)); "
             f"settings {json.dumps(settings)}, {repo.meta.get('train_seconds', '?')} s in all:\n\n")
    counts = sorted({p for _, p in repo.entries})
    body += table(["task"] + [f"P={p}" for p in counts],
                  [[t] + [f"{repo.entries[(t, p)].accuracy:.3f}" if (t, p) in repo.entries else "-" for p in counts]
                   for t in tasks])
    body += "\n\nOptimiser comparison (task inverted, P = 4; probe / prompts accuracy on the profiling split):\n\n"
    body += table(["optimiser", "P=0 probe", "P=4 prompts"], [[n, f"{a:.3f}", f"{b:.3f}"] for n, a, b in OPTIMISER_SWEEP])
    if args.accumulate_dir:
        acc_repo, acc_profiles = measure(Path(args.accumulate_dir), [g for g in gammas if g > 0], args.cache_dir)
        body += "\n\nPrompt mode, test-split accuracy (replace / accumulate):\n\n" + table(
            ["task"] + [f"{g:+d}" for g in gammas if g > 0],
            [[t] + [f"{profiles['test'].of(t, g):.3f} / {acc_profiles['test'].of(t, g):.3f}" for g in gammas if g > 0]
             for t in acc_repo.tasks])
    png = PLOTS / "otas_accuracy_vit-demo.png"
    plot(profiles, list(gammas), png)
    notes = ("Measured through the serving executables (batch 32, one per gamma) on the 180 + 180 held-out images of "
             "each task that neither the backbone nor the prompts were trained on. gamma < 0 merges |gamma| tokens per "
             "layer (demo mapping of the paper's -20..-5, jaxserve/registry.py OTAS_GAMMAS); gamma > 0 runs the task's "
             "(task, P = gamma) prompts and head. The optimiser table was measured with the same training code "
             "(jaxserve/prompt_training.py train_repository) in separate runs on this machine; it is not re-run here."
             f"\n\n![accuracy](plots/{png.name})")
    if args.write:
        record("otas-accuracy", "OTAS: accuracy against gamma (demo ViT, three tasks)", body, notes)
    print(body)
    print(notes)


if __name__ == "__main__":
    main()
