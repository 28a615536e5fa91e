"""INFaaS model variants for the OTAS comparison: small / base / large digits ViTs, profiled.

    nice -n 10 python -m bench.otas_infaas_variants [--epochs 20]

The paper's INFaaS baseline switches among ViT-S, ViT-B and ViT-L as the load changes, paying
the I/O of loading the new model. Our counterpart, at the demo's scale: "S" and "L" digits
ViTs trained here exactly like the demo ViT ("B", training/train_vit_digits.py, 20 epochs),

    S: hidden 64,  4 layers, 2 heads, MLP 128
    B: the shipped demo ViT (hidden 128, 4 layers, 4 heads, MLP 256)
    L: hidden 192, 6 layers, 6 heads, MLP 384

each with its own heads for the three tasks (its digits head, and linear probes on its frozen
features for parity and inverted: INFaaS variants carry no prompts). Measured per variant:
latency per batch size at gamma 0 (serving executables, timed round-robin across all three
variants in one process, minimum over rounds; bench/otas_utility.py anchors them to the cost
model through the base variant, the very executable OTAS runs at gamma 0), accuracy per
task on the profiling split (what INFaaS plans with) and per-image correctness on the test
split (what the utility simulation scores), and the switching cost: the wall time to load the
variant — orbax restore of its weights plus its executables from the compile cache — the
CPU analogue of INFaaS's model load. Everything goes to ``bench/otas_infaas_variants.json``,
read by bench/otas_utility.py. Checkpoints go to compiled_cache/otas-variants (not shipped).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "otas_infaas_variants.json"
BATCHES = (1, 2, 4, 8, 16, 32)


def variant_configs():
    from jaxserve.models.vit import VIT_CONFIGS, ViTConfig

    demo = VIT_CONFIGS["vit-demo"]
    return {
        "vit-demo-s": ViTConfig(image_size=32, patch_size=8, num_channels=1, hidden_size=64, num_layers=4,
                                num_heads=2, mlp_dim=128, num_classes=10),
        "vit-demo": demo,
        "vit-demo-l": ViTConfig(image_size=32, patch_size=8, num_channels=1, hidden_size=192, num_layers=6,
                                num_heads=6, mlp_dim=384, num_classes=10),
    }


def build(name: str, cfg, ckpt_root: Path, epochs: int, cache, log=print):
    from jaxserve.models.vit import VIT_CONFIGS
    from jaxserve.polymorph import PolymorphTable
    from jaxserve.datasets import DIGIT_TASKS, digit_task_split
    from jaxserve.prompts import PromptRepository, backbone_head_entry
    from jaxserve.registry import vit_demo_dir
    from jaxserve.runtime import ImageRuntime, TaskHead
    from jaxserve.sched.base import ShapeGrid
    from jaxserve.servables import vit_servable, weights_of
    from jaxserve.prompt_training import PromptSettings, train_repository
    from jaxserve.models.vit import load_vit_checkpoint
    from training.train_vit_digits import train

    if name == "vit-demo":
        ckpt = vit_demo_dir()
    else:
        ckpt = ckpt_root / name
        if not (ckpt / "meta.json").exists():
            VIT_CONFIGS.setdefault(name, cfg)  # train() looks configs up by name
            log(f"training {name} ({epochs} epochs)")
            train(name, ckpt, epochs=epochs, progress=False)
    meta = json.loads((ckpt / "meta.json").read_text())
    norm = meta["normalisation"]
    _, model = load_vit_checkpoint(ckpt)
    shape = (cfg.image_size, cfg.image_size, cfg.num_channels)
    splits = {t: (digit_task_split(t, "train", shape), digit_task_split(t, "profile", shape), DIGIT_TASKS[t].labels)
              for t in DIGIT_TASKS if t != "digits"}
    repo = train_repository(cfg, model, splits, (), norm["mean"], norm["std"], PromptSettings(), progress=False)
    repo.add(backbone_head_entry(model, "digits"), DIGIT_TASKS["digits"].labels)
    grid = ShapeGrid(BATCHES)
    table = PolymorphTable(vit_servable(name, cfg, grid, "replace", repo.num_classes), cache)
    table.warmup()
    heads = {t: TaskHead(t, labels, None, None, feature="logits") for t, labels in repo.labels.items()}
    rt = ImageRuntime(name, table, weights_of(model), heads, prompts=repo, image_shape=shape, pixel_mean=norm["mean"],
                      pixel_std=norm["std"])

    accuracy, correct = {}, {}
    for task in repo.tasks:
        labels = heads[task].labels
        for split in ("profile", "test"):
            data = digit_task_split(task, split, shape)
            pred = []
            for start in range(0, len(data), 32):
                imgs = list(data.images[start:start + 32])
                pred += [labels.index(it["label"]) for it in rt.execute(grid.cell_for(len(imgs)), imgs,
                                                                         [task] * len(imgs)).items]
            hit = np.asarray(pred) == data.labels
            if split == "profile":
                accuracy[task] = float(hit.mean())
            else:
                correct[task] = hit.tolist()
    loads = []  # switching cost: restore weights + load every executable from the compile cache
    for _ in range(3):
        t0 = time.perf_counter()
        load_vit_checkpoint(ckpt)
        PolymorphTable(vit_servable(name, cfg, grid, "replace", repo.num_classes), cache).warmup()
        loads.append(time.perf_counter() - t0)
    params = sum(int(np.prod(x.shape)) for x in __import__("jax").tree.leaves(weights_of(model)))
    log(f"{name}: params {params}, accuracy {accuracy}, load {np.median(loads):.2f}s")
    return rt, {"name": name, "params": params, "accuracy": accuracy, "correct": correct,
                "load_seconds": float(np.median(loads)), "test_accuracy": meta.get("test_accuracy")}


def time_together(runtimes: dict, rounds: int) -> dict:
    """Latency per batch size of every variant, timed round-robin across *all* variants' cells in
    one process (minimum over rounds), so the shared machine's load hits them alike; the utility
    bench anchors these to the cost model through the base variant, which is the very executable
    OTAS runs at gamma 0."""
    rng = np.random.default_rng(0)
    jobs = []
    for name, rt in runtimes.items():
        for c in rt.grid.cells():
            images = list(rng.random((c.batch, *rt.image_shape), dtype=np.float32))
            rt.execute(c, images, ["digits"] * c.batch)
            jobs.append((name, rt, c, images))
    samples = {(n, c): [] for n, _, c, _ in jobs}
    for _ in range(rounds):
        for name, rt, c, images in jobs:
            samples[(name, c)].append(rt.execute(c, images, ["digits"] * c.batch).compute_seconds)
    return {name: [[c.batch, float(np.min(samples[(name, c)]))] for c in rt.grid.cells()]
            for name, rt in runtimes.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--cache-dir", default="compiled_cache")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    from jaxserve.compile_cache import CompileCache

    cache = CompileCache(args.cache_dir)
    root = Path(args.cache_dir) / "otas-variants"
    built = {n: build(n, c, root, args.epochs, cache) for n, c in variant_configs().items()}
    latency = time_together({n: rt for n, (rt, _) in built.items()}, args.rounds)
    variants = [{**info, "latency": latency[n]} for n, (_, info) in built.items()]
    for v in variants:
        print(f"{v['name']}: batch-32 {v['latency'][-1][1] * 1e3:.2f} ms")
    switch = float(np.mean([v["load_seconds"] for v in variants]))
    Path(args.out).write_text(json.dumps({"switch_seconds": switch, "variants": variants}) + "\n")
    print(f"switch cost (mean load time) {switch:.2f}s -> {args.out}")


if __name__ == "__main__":
    main()
