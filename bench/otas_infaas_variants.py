"""INFaaS model variants for the OTAS comparison: small / base / large digits ViTs, or DINOv2
ViT-S/14 truncated to fewer layers, profiled.

    nice -n 10 python -m bench.otas_infaas_variants [--epochs 20]
    nice -n 10 python -m bench.otas_infaas_variants --model dinov2-s14 [--depths 6,9]

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

``--model dinov2-s14`` (issue 23, item 3): a pretrained backbone has no smaller sibling here, so
the cheaper variants are DINOv2 ViT-S/14 *truncated*: its first ``d`` of 12 blocks, then its final
norm (``jaxserve.models.vit.truncate_vit``), for each ``d`` of ``--depths``, next to the whole
model (the very executables OTAS runs at gamma 0). Each variant has its own linear probes for
mnist and animals, trained on its own final-normed CLS state exactly as
training/train_dinov2_probes.py trains the whole model's (same subsets of
``datasets.dinov2_task_split``, same ``fit_linear_head``); the features of every depth come from
one forward pass (``cls_by_depth``), which also gives the probe accuracy at *every* depth 1..12
(``depth_sweep``, what the depths are chosen from). The whole model keeps its shipped probes (the
ones OTAS serves; the sweep's depth 12 refits them and must agree). Measured as for the demo:
latency per batch 1, 2, 4, 8 at gamma 0 (round-robin across variants, minimum over rounds),
accuracy per task and per-image correctness through each variant's compiled executables, and
the load time (its weights from a safetensors file, its probe repository, its executables from
the compile cache). Decision: DINOv2's tasks define only a training and a held-out subset, and
the held-out images are both the profiling set (accuracy.json, what every policy plans with) and
the test images the utility simulation scores (as bench/otas_live.py does for this model), so
accuracy is the mean of the per-image correctness; the same holds for OTAS's profile, so no
policy is favoured. The JSON also holds the whole model's per-image correctness at every OTAS
gamma (``gamma_correct``: what OTAS, PetS and fixed ToMe are scored with). Written to
``bench/otas_infaas_variants_dinov2-s14.json``; weights and probes of the variants go to
compiled_cache/otas-variants-dinov2-s14 (not shipped).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "otas_infaas_variants.json"
BATCHES = (1, 2, 4, 8, 16, 32)
DINOV2 = "dinov2-s14"
DINOV2_OUT = Path(__file__).parent / f"otas_infaas_variants_{DINOV2}.json"
DINOV2_BATCHES = (1, 2, 4, 8)  # its OTAS grid's (bench/otas_live.py): batch 8 takes ~0.6 s here


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
    from jaxserve.prompts import backbone_head_entry
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
        task = rt.prompts.tasks[0]
        for c in rt.grid.cells():
            images = list(rng.random((c.batch, *rt.image_shape), dtype=np.float32))
            rt.execute(c, images, [task] * c.batch)
            jobs.append((name, rt, c, images, task))
    samples = {(n, c): [] for n, _, c, _, _ in jobs}
    for _ in range(rounds):
        for name, rt, c, images, task in jobs:
            samples[(name, c)].append(rt.execute(c, images, [task] * c.batch).compute_seconds)
    return {name: [[c.batch, float(np.min(samples[(name, c)]))] for c in rt.grid.cells()]
            for name, rt in runtimes.items()}


# ------------------------------------------------------------------------------- DINOv2 ViT-S/14


def dinov2_features(model, images01: np.ndarray, depths, log=print) -> dict[int, np.ndarray]:
    """{depth: [N, D] final-normed CLS states} of images in [0, 1] (ImageNet-normalised here, as
    training/train_dinov2_probes.py and serving do), every depth from one forward pass at gamma 0,
    in batches of that script's size (zero-padded at the end)."""
    import jax
    from flax import nnx

    from jaxserve.models.vit import cls_by_depth
    from jaxserve.registry import IMAGENET_MEAN, IMAGENET_STD
    from training.train_dinov2_probes import BATCH

    graphdef, state = nnx.split(model)
    depths = tuple(sorted(depths))
    forward = jax.jit(lambda st, px: cls_by_depth(nnx.merge(graphdef, st), px, depths))
    mean, std = np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)
    out = {d: [] for d in depths}
    t0 = time.perf_counter()
    for start in range(0, len(images01), BATCH):
        chunk = (images01[start:start + BATCH] - mean) / std
        real = len(chunk)
        if real < BATCH:
            chunk = np.concatenate([chunk, np.zeros((BATCH - real, *chunk.shape[1:]), np.float32)])
        for d, cls in forward(state, chunk).items():
            out[d].append(np.asarray(cls)[:real])
    log(f"  {len(images01)} images, depths {depths[0]}..{depths[-1]}, in {time.perf_counter() - t0:.1f}s")
    return {d: np.concatenate(v) for d, v in out.items()}


def dinov2_probes(root: Path, log=print) -> tuple[dict, dict, dict]:
    """Linear probes at every depth 1..12, fitted as training/train_dinov2_probes.py fits the
    whole model's (its subsets, its ``fit_linear_head``, seed 0) on that depth's CLS state:
    ({depth: {task: (head_w, head_b)}}, depth_sweep {depth: {task: held-out accuracy}}, {task:
    labels}). The features are cached in ``root`` (one pass over 1,040 images takes minutes)."""
    from jaxserve.datasets import DINOV2_TASKS, dinov2_task_split
    from jaxserve.registry import load_dinov2
    from training.train_dinov2_probes import fit_linear_head

    cfg, model = load_dinov2()
    depths = tuple(range(1, cfg.num_layers + 1))
    probes, sweep, labels_of = {d: {} for d in depths}, {d: {} for d in depths}, {}
    for task in DINOV2_TASKS:
        train, labels_of[task] = dinov2_task_split(task, "train", cfg.image_size)
        held, _ = dinov2_task_split(task, "heldout", cfg.image_size)
        cached = root / f"features-{task}.npz"  # default subsets (32 / 20 per class, seed 0)
        if cached.exists():
            with np.load(cached) as z:
                feats = {(s, d): z[f"{s}{d}"] for s in ("train", "held") for d in depths}
        else:
            log(f"{task}: CLS states at every depth, {len(train)} training + {len(held)} held-out images")
            tr, he = dinov2_features(model, train.images, depths, log), dinov2_features(model, held.images, depths, log)
            feats = {**{("train", d): tr[d] for d in depths}, **{("held", d): he[d] for d in depths}}
            root.mkdir(parents=True, exist_ok=True)
            np.savez(cached, **{f"{s}{d}": v for (s, d), v in feats.items()})
        for d in depths:
            w, b = fit_linear_head(feats[("train", d)], train.labels, len(labels_of[task]))
            probes[d][task] = (w, b)
            sweep[d][task] = float(np.mean(np.argmax(feats[("held", d)] @ w + b, axis=1) == held.labels))
        log(f"{task}: held-out probe accuracy by depth " + " ".join(f"{d}:{sweep[d][task]:.3f}" for d in depths))
    return probes, sweep, labels_of


def dinov2_variant_name(depth: int) -> str:
    return DINOV2 if depth == 12 else f"{DINOV2}-d{depth}"


def save_dinov2_variant(root: Path, depth: int, probes: dict, labels_of: dict) -> Path:
    """Write the truncated model's weights (safetensors, timm names) and its probe repository
    under ``root / name``; the whole model (depth 12) keeps its shipped repository."""
    from jaxserve.models.vit import export_timm_state_dict, save_safetensors, truncate_vit
    from jaxserve.prompts import PromptEntry, PromptRepository
    from jaxserve.registry import load_dinov2

    folder = root / dinov2_variant_name(depth)
    folder.mkdir(parents=True, exist_ok=True)
    cfg, model = load_dinov2()
    small = truncate_vit(model, depth) if depth < cfg.num_layers else model
    save_safetensors(str(folder / "model.safetensors"), export_timm_state_dict(small))
    if depth < cfg.num_layers:
        repo = PromptRepository(small.config.key(), depth, cfg.hidden_size,
                                meta={"training": {"probe": f"linear head on the final-normed CLS state after block "
                                                            f"{depth} of 12 (bench/otas_infaas_variants.py)"}})
        for task, (w, b) in probes[depth].items():
            repo.add(PromptEntry(task, 0, None, w, b), labels_of[task])
        repo.save(folder / "probes")
    return folder


def load_dinov2_variant(folder: Path, depth: int, grid, cache):
    """What INFaaS pays to switch to a variant, done for real: its weights from its safetensors
    file, its probe repository, and its executables from the compile cache. (ImageRuntime, its
    config.)"""
    import dataclasses

    from safetensors.numpy import load_file

    from jaxserve.models.vit import VIT_CONFIGS, load_timm_state_dict
    from jaxserve.polymorph import PolymorphTable
    from jaxserve.prompts import PromptRepository
    from jaxserve.registry import IMAGENET_MEAN, IMAGENET_STD, dinov2_prompts_dir
    from jaxserve.runtime import ImageRuntime, TaskHead
    from jaxserve.servables import vit_servable, weights_of

    cfg = dataclasses.replace(VIT_CONFIGS[DINOV2], num_layers=depth)
    model = load_timm_state_dict(cfg, load_file(str(folder / "model.safetensors")))
    repo = PromptRepository.load(dinov2_prompts_dir() if depth == 12 else folder / "probes", config_key=cfg.key())
    name = dinov2_variant_name(depth)
    table = PolymorphTable(vit_servable(name, cfg, grid, repo.prompt_mode, repo.num_classes), cache)
    table.warmup()
    heads = {t: TaskHead(t, labels, None, None, feature="logits") for t, labels in repo.labels.items()}
    return ImageRuntime(name, table, weights_of(model), heads, prompts=repo, num_layers=depth,
                        image_shape=(cfg.image_size, cfg.image_size, cfg.num_channels),
                        pixel_mean=np.asarray(IMAGENET_MEAN, np.float32),
                        pixel_std=np.asarray(IMAGENET_STD, np.float32), resizes=True), cfg


def dinov2_correct(rt, heldout: dict, gamma: int = 0) -> dict:
    """{task: bool[held-out images]}: ``rt``'s answers at ``gamma`` through its executables (batches
    of its largest size), against the truth."""
    out = {}
    top = rt.grid.max_batch
    for task, (split, labels) in heldout.items():
        pred = []
        for start in range(0, len(split), top):
            imgs = list(split.images[start:start + top])
            items = rt.execute(rt.grid.cell_for(len(imgs), 0, gamma), imgs, [task] * len(imgs)).items
            pred += [labels.index(it["label"]) for it in items]
        out[task] = np.asarray(pred) == split.labels
    return out


def dinov2_gamma_correct(cache, heldout: dict, log=print) -> dict:
    """{task: {str(gamma): [bool per held-out image]}}: the whole DINOv2's answers at each of its
    OTAS gammas (prompts included), through the serving executables at its largest batch."""
    from jaxserve.registry import OTAS_GAMMAS, load_image_runtime
    from jaxserve.sched.base import ShapeGrid

    gammas = OTAS_GAMMAS[DINOV2]
    log(f"{DINOV2}: per-image correctness at gammas {gammas} (batch {max(DINOV2_BATCHES)})")
    rt = load_image_runtime(DINOV2, cache, ShapeGrid((max(DINOV2_BATCHES),), gammas=gammas))
    out = {t: {} for t in heldout}
    for g in gammas:
        for t, c in dinov2_correct(rt, heldout, g).items():
            out[t][str(g)] = c.tolist()
    return out


def refresh_gamma_correct(cache_dir: str, out: Path, log=print) -> None:
    """``--gamma-correct-only``: rewrite only the ``gamma_correct`` block of an existing variants
    file ``out`` for today's OTAS gammas and prompt repository (new prompts change the whole
    model's answers at gamma > 0, not the truncated variants' measurements, which are kept); the
    file records when (``gamma_correct_refreshed``). Refuses when gamma 0's answers disagree with the
    file's whole-model variant: then the backbone or its probes changed and everything must be rebuilt."""
    from datetime import datetime, timezone

    from jaxserve.compile_cache import CompileCache
    from jaxserve.datasets import DINOV2_TASKS, dinov2_task_split

    raw = json.loads(out.read_text())
    heldout = {t: dinov2_task_split(t, "heldout", 224) for t in DINOV2_TASKS}
    gamma_correct = dinov2_gamma_correct(CompileCache(cache_dir), heldout, log)
    whole = next(v for v in raw["variants"] if v["name"] == DINOV2)
    for t in DINOV2_TASKS:
        if gamma_correct[t]["0"] != whole["correct"][t]:
            raise SystemExit(f"{t}: gamma 0's answers differ from {out}'s {DINOV2} variant: the probes or the "
                             "backbone changed; rebuild the whole file (without --gamma-correct-only)")
    raw["gamma_correct"] = gamma_correct
    raw["gamma_correct_refreshed"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out.write_text(json.dumps(raw) + "\n")
    log(f"gamma_correct refreshed for gammas {sorted(int(g) for g in gamma_correct[DINOV2_TASKS[0]])} -> {out}")


def build_dinov2(depths, cache_dir: str, rounds: int, loads: int, out: Path, log=print) -> None:
    """The module docstring's ``--model dinov2-s14`` run: every step, then the JSON at ``out``."""
    import jax

    from jaxserve.compile_cache import CompileCache
    from jaxserve.datasets import DINOV2_TASKS, dinov2_task_split
    from jaxserve.sched.base import ShapeGrid

    cache = CompileCache(cache_dir)
    root = Path(cache_dir) / f"otas-variants-{DINOV2}"
    depths = sorted({int(d) for d in depths} | {12})
    probes, sweep, labels_of = dinov2_probes(root, log)
    heldout = {t: dinov2_task_split(t, "heldout", 224) for t in DINOV2_TASKS}
    grid = ShapeGrid(DINOV2_BATCHES)
    runtimes, infos = {}, {}
    for depth in depths:
        name = dinov2_variant_name(depth)
        folder = root / name
        if not (folder / "model.safetensors").exists() or depth < 12 and not (folder / "probes").exists():
            save_dinov2_variant(root, depth, probes, labels_of)
        log(f"{name}: compiling / loading its executables")
        rt, cfg = load_dinov2_variant(folder, depth, grid, cache)  # the first load compiles what is missing
        seconds = []
        for _ in range(loads):  # switching cost: every load after the cache holds the executables
            t0 = time.perf_counter()
            load_dinov2_variant(folder, depth, grid, cache)
            seconds.append(time.perf_counter() - t0)
        correct = dinov2_correct(rt, heldout)
        accuracy = {t: float(c.mean()) for t, c in correct.items()}
        params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(rt.weights))
        log(f"{name}: {depth} layers, {params} params, held-out accuracy {accuracy}, sweep {sweep[depth]}, "
            f"load {np.median(seconds):.2f}s ({', '.join(f'{x:.2f}' for x in seconds)})")
        runtimes[name] = rt
        infos[name] = {"name": name, "depth": depth, "params": params, "accuracy": accuracy,
                       "correct": {t: c.tolist() for t, c in correct.items()},
                       "load_seconds": float(np.median(seconds)), "loads": seconds}
    log("latency: round-robin across variants")
    latency = time_together(runtimes, rounds)
    del runtimes
    gamma_correct = dinov2_gamma_correct(cache, heldout, log)
    for t in DINOV2_TASKS:  # the same executable at gamma 0 (another grid, same cache entry): the same answers
        if gamma_correct[t]["0"] != infos[DINOV2]["correct"][t]:
            log(f"WARNING: {t}: gamma-0 correctness differs between the batch-{max(DINOV2_BATCHES)} runs")
    variants = [{**infos[n], "latency": latency[n]} for n in infos]
    switch = float(np.mean([v["load_seconds"] for v in variants]))
    full = {b: t for b, t in latency[DINOV2]}
    for v in variants:
        log(f"{v['name']}: batch-8 {v['latency'][-1][1] * 1e3:.0f} ms ({full[8] / v['latency'][-1][1]:.2f}x the whole "
            f"model's speed), accuracy {v['accuracy']}, load {v['load_seconds']:.2f}s")
    out.write_text(json.dumps({
        "model": DINOV2, "switch_seconds": switch, "batches": list(DINOV2_BATCHES), "rounds": rounds,
        "held_out": "datasets.dinov2_task_split(task, 'heldout', 224): 200 images per task (20 per class), the "
                    "profiling set and the images the utility simulation scores",
        "depth_sweep": {str(d): sweep[d] for d in sorted(sweep)},
        "gamma_correct": gamma_correct, "variants": variants}) + "\n")
    log(f"switch cost (mean load time) {switch:.2f}s -> {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit-demo", choices=("vit-demo", DINOV2))
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--depths", default="6,9", help=f"{DINOV2}: the truncated variants' depths (of 12)")
    p.add_argument("--rounds", type=int, default=None, help="default 41 (vit-demo), 15 (dinov2-s14)")
    p.add_argument("--loads", type=int, default=3, help="timed loads per variant (median kept)")
    p.add_argument("--cache-dir", default="compiled_cache")
    p.add_argument("--out", default=None)
    p.add_argument("--gamma-correct-only", action="store_true",
                   help=f"{DINOV2}: refresh only the per-gamma correctness of an existing file (after new prompts)")
    args = p.parse_args()
    if args.gamma_correct_only:
        if args.model != DINOV2:
            raise SystemExit(f"--gamma-correct-only: only for --model {DINOV2}")
        refresh_gamma_correct(args.cache_dir, Path(args.out or DINOV2_OUT))
        return
    if args.model == DINOV2:
        build_dinov2([int(d) for d in args.depths.split(",")], args.cache_dir, args.rounds or 15, args.loads,
                     Path(args.out or DINOV2_OUT))
        return
    args.rounds = args.rounds or 41
    args.out = args.out or str(OUT)
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
