"""Tabi's offline profiling (§5): every cascade candidate of every text task, on validation, and the
chosen ones reported on test.

    jaxserve profile --cascade            (or: python -m training.profile_cascade)

Per task (``jaxserve.datasets.TEXT_TASKS``), with the calibrated heads of every encoder
(``training.train_cascade_heads`` writes them and their per-item probabilities):

1. **Costs.** Each model's batch-1 latency per length bucket, measured here on its jitted
   encoder (the function the servables compile), so a request's cost is its bucket's latency;
   a candidate's cost is the mean over the split with the expected routing
   (``jaxserve.sched.tabi.evaluate``).
2. **Importance.** Every first-level model (MiniLM-L3, MiniLM-L6, bge-small) runs its
   importance executable (``make_encode_fn(..., importance=True)``: Eq. 5's vector, summed
   over layers, heads and real queries) over the validation and test texts.
3. **alpha.** As in §5, one representative efficient model (MiniLM-L3, the cheapest) prunes
   the validation texts at alpha = 0.5, 0.6, ... and the largest model runs them, until its
   accuracy falls more than 2 points below its accuracy on the full texts; the last alpha
   within 2 points is the task's alpha. Every first-level model then prunes at that alpha for
   the models after it (validation and test).
4. **Candidates.** The chains of the issue (each model alone, L3/L6/bge -> MPNet, L3 -> bge ->
   MPNet, L3 -> L6 -> MPNet), with and without pruning, each over the c sweep and k grid
   (``profile_candidates``), all kept in the profile; the default accuracy target is the
   largest model's validation accuracy minus 0.5 points. The cheapest candidate meeting it,
   each model alone and the INFaaS-like choice are evaluated on test with their validation
   weights.
5. **Replay.** ``jaxserve/assets/cascade/<task>-replay.npz``: the test split's per-item
   calibrated probabilities of every model on full and (per first model) pruned texts, and
   the token lengths, which ``jaxserve simulate --policy tabi`` replays.

Writes ``jaxserve/profiles/cascade.json`` (``jaxserve.sched.tabi.load_cascade_profile``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxserve.cascade import join_words, kept_words, truncated_text
from jaxserve.datasets import TEXT_TASKS, text_task_split
from jaxserve.registry import ASSETS, PROFILES, TEXT_MODELS
from jaxserve.runtime import TaskHead
from jaxserve.sched.base import bucket_for_length
from jaxserve.sched.tabi import (LevelData, choose, evaluate, profile_candidates, select, TaskProfile)
from training.text_embeddings import EMBED_GRID, MAX_TOKENS, TextEmbedder, cached_embeddings

LARGE = "mpnet-base"
FIRST = ("minilm-l3", "minilm-l6", "bge-small")
REPRESENTATIVE = "minilm-l3"  # §5: one efficient model's attention profiles alpha
CASCADES = (("minilm-l3", LARGE), ("minilm-l6", LARGE), ("bge-small", LARGE),
            ("minilm-l3", "bge-small", LARGE), ("minilm-l3", "minilm-l6", LARGE))
ALPHA_START, ALPHA_STEP, ALPHA_MAX_LOSS = 0.5, 0.1, 0.02
PROFILE_PATH = PROFILES / "cascade.json"
REPLAY_DIR = ASSETS / "cascade"


class Encoder:
    """One text model for profiling: tokenizer, jitted encoder with importance, head per task,
    batch-1 latency per bucket, and the cached embedder of training.text_embeddings."""

    def __init__(self, name: str):
        import jax
        from flax import nnx

        from jaxserve.models.bert import make_encode_fn
        from jaxserve.models.tokenizer import TextTokenizer
        from jaxserve.registry import load_text_model

        self.name = name
        cfg, model, tokenizer_json = load_text_model(name)
        self.tokenizer = TextTokenizer(tokenizer_json)
        graphdef, self.state = nnx.split(model)
        self._importance = jax.jit(make_encode_fn(graphdef, importance=True))
        self._plain = jax.jit(make_encode_fn(graphdef))
        self.embedder = TextEmbedder(name)
        self.bucket_seconds: dict[int, float] = {}

    def head(self, task: str) -> TaskHead:
        return TaskHead.load(task, ASSETS / "heads" / self.name / f"{task}.npz")

    def probabilities(self, task: str, texts: list[str], desc: str) -> np.ndarray:
        features, _, _ = cached_embeddings(self.embedder, texts, desc=f"{self.name} {desc}")
        return self.head(task).probabilities(features)

    def lengths(self, texts: list[str]) -> np.ndarray:
        return np.array([min(len(ids), MAX_TOKENS) for ids in self.tokenizer.encode(texts)])

    def measure_buckets(self, repeats: int = 7) -> None:
        """Median batch-1 latency of each embedding bucket (after one warm call)."""
        import jax

        for seq in EMBED_GRID.seq_buckets:
            ids = np.full((1, seq), 1000, np.int32)
            mask = np.ones((1, seq), np.int32)
            jax.block_until_ready(self._plain(self.state, ids, mask))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(self._plain(self.state, ids, mask))
                times.append(time.perf_counter() - t0)
            self.bucket_seconds[seq] = float(np.median(times))

    def cost(self, lengths: np.ndarray) -> float:
        """Mean batch-1 seconds of requests of these token lengths."""
        return float(np.mean([self.bucket_seconds[bucket_for_length(int(n), EMBED_GRID.seq_buckets)]
                              for n in lengths]))

    def pruned(self, texts: list[str], alpha: float, importance: list[np.ndarray]) -> list[str]:
        """Each text pruned by Eq. 5 with this model's importance (jaxserve.cascade's rules)."""
        out = []
        for text, imp in zip(texts, importance):
            ids, word_of_token, spans = self.tokenizer.encode_words(text)
            keep = kept_words(imp[: len(ids)], word_of_token, len(spans), alpha)
            out.append(join_words(text, spans, keep))
        return out

    def importance(self, texts: list[str], desc: str) -> tuple[list[str], list[np.ndarray]]:
        """(texts cut to MAX_TOKENS at a whole word, their importance vectors), batched by bucket."""
        from jaxserve.polymorph import pad_token_batch

        cut = [truncated_text(self.tokenizer, t, MAX_TOKENS) for t in texts]
        ids = [c[1] for c in cut]
        out: list[np.ndarray | None] = [None] * len(texts)
        order = np.argsort([len(i) for i in ids], kind="stable")
        batch = EMBED_GRID.max_batch
        chunks = [order[i:i + batch] for i in range(0, len(order), batch)]
        for part in tqdm(chunks, desc=f"{self.name} importance {desc}", unit="batch", mininterval=5.0):
            cell = EMBED_GRID.cell_for(batch, max(len(ids[i]) for i in part))
            x, mask = pad_token_batch([ids[i] for i in part], cell, pad_id=self.tokenizer.pad_id)
            imp = np.asarray(self._importance(self.state, x, mask)["_importance"])
            for row, i in enumerate(part):
                out[i] = imp[row, : len(ids[i])]
        return [c[0] for c in cut], out


def profile_task(task: str, enc: dict[str, Encoder], progress: bool = True) -> tuple[dict, dict]:
    """(the task's profile entry, its replay arrays)."""
    split = {s: text_task_split(task, s)[:2] for s in ("val", "test")}
    labels_of = {s: split[s][1] for s in split}
    probs = {m: {s: e.probabilities(task, split[s][0], f"{task}/{s}") for s in split} for m, e in enc.items()}
    lengths = {m: {s: e.lengths(split[s][0]) for s in split} for m, e in enc.items()}
    imp = {m: {s: enc[m].importance(split[s][0], f"{task}/{s}") for s in split} for m in FIRST}

    # alpha, by the representative's pruning, on validation
    rep_texts, rep_imp = imp[REPRESENTATIVE]["val"]
    full_acc = float((probs[LARGE]["val"].argmax(1) == labels_of["val"]).mean())
    alpha, sweep = None, []
    a = ALPHA_START
    while a < 3.0:
        pruned = enc[REPRESENTATIVE].pruned(rep_texts, a, rep_imp)
        acc = float((enc[LARGE].probabilities(task, pruned, f"{task}/val alpha={a:.1f}").argmax(1)
                     == labels_of["val"]).mean())
        kept = float(np.mean(enc[LARGE].lengths(pruned)) / np.mean(lengths[LARGE]["val"]))
        sweep.append({"alpha": round(a, 1), "large_accuracy": acc, "token_share_kept": kept})
        if full_acc - acc > ALPHA_MAX_LOSS:
            break
        alpha = round(a, 1)
        a += ALPHA_STEP

    # every first model prunes at alpha for the models after it
    data = {s: {} for s in split}
    pruned_len = {}
    for s in split:
        for m, e in enc.items():
            data[s][m] = LevelData(probs[m][s], e.cost(lengths[m][s]))
    per_first = {}
    for first in FIRST:
        later = sorted({m for chain in CASCADES if chain[0] == first for m in chain[1:]})
        per_first[first] = {}
        for s in split:
            d = dict(data[s])
            if alpha is not None:
                texts, importance = imp[first][s]
                pruned = enc[first].pruned(texts, alpha, importance)
                for m in later:
                    p = enc[m].probabilities(task, pruned, f"{task}/{s} pruned by {first}")
                    n = enc[m].lengths(pruned)
                    pruned_len[(first, m, s)] = n
                    d[m] = LevelData(probs[m][s], d[m].cost, {alpha: p}, {alpha: enc[m].cost(n)})
                    probs.setdefault(f"{m}|pruned-by|{first}", {})[s] = p
            per_first[first][s] = d
    alphas = (None,) if alpha is None else (None, alpha)
    labels = TEXT_TASKS[task].labels
    candidates = profile_candidates(task, [(m,) for m in enc], data["val"], labels_of["val"])
    for first in FIRST:
        chains = [c for c in CASCADES if c[0] == first]
        candidates += profile_candidates(task, chains, per_first[first]["val"], labels_of["val"], alphas)
    target = float((probs[LARGE]["val"].argmax(1) == labels_of["val"]).mean()) - 0.005
    entry = TaskProfile(labels, target, tuple(candidates))

    def on_test(c):
        d = per_first.get(c.levels[0], {}).get("test", data["test"])
        ev = evaluate(c.levels, c.thresholds, c.k, c.alpha, d, labels_of["test"], c.weights)
        return {"candidate": c.name(), "accuracy": ev["accuracy"], "cost_ms": ev["cost"] * 1e3,
                "exit_shares": ev["exit_shares"]}

    test = {p: on_test(choose(p, entry)) for p in ("tabi", "tabi-small", "tabi-large", "tabi-infaas")}
    test["singles"] = {m: on_test(next(c for c in candidates if c.levels == (m,))) for m in enc}
    chosen = select(candidates, target)
    pruned_share = None
    if chosen.alpha is not None and len(chosen.levels) > 1:
        n = pruned_len[(chosen.levels[0], chosen.levels[1], "test")]
        pruned_share = 1.0 - float(n.sum() / lengths[chosen.levels[1]]["test"].sum())
    out = {"labels": list(labels), "target_accuracy": target, "alpha": alpha, "alpha_sweep": sweep,
           "candidates": [c.to_json() for c in candidates], "test": test, "pruned_token_share_test": pruned_share,
           "bucket_ms": {m: {str(b): t * 1e3 for b, t in e.bucket_seconds.items()} for m, e in enc.items()}}
    replay = {"labels": labels_of["test"], "alpha": np.array(-1.0 if alpha is None else alpha)}
    for m in enc:
        replay[f"probs/{m}"] = probs[m]["test"].astype(np.float16)
        replay[f"length/{m}"] = lengths[m]["test"].astype(np.int16)
    for (first, m, s), n in pruned_len.items():
        if s == "test":
            replay[f"length/{m}|pruned-by|{first}"] = n.astype(np.int16)
            replay[f"probs/{m}|pruned-by|{first}"] = probs[f"{m}|pruned-by|{first}"]["test"].astype(np.float16)
    return out, replay


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", action="append", choices=sorted(TEXT_TASKS), help="default: every task")
    ap.add_argument("--out", type=Path, default=PROFILE_PATH)
    args = ap.parse_args(argv)
    from jaxserve.profiler import machine_description

    enc = {}
    for m in TEXT_MODELS:
        print(f"loading {m}", flush=True)
        enc[m] = Encoder(m)
        enc[m].measure_buckets()
    tasks = args.task or sorted(TEXT_TASKS)
    profile = json.loads(args.out.read_text()) if args.out.exists() else {"tasks": {}}
    profile["machine"] = machine_description()
    REPLAY_DIR.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        entry, replay = profile_task(task, enc)
        profile["tasks"][task] = entry
        np.savez_compressed(REPLAY_DIR / f"{task}-replay.npz", **replay)
        t = entry["test"]["tabi"]
        print(f"{task}: alpha {entry['alpha']}; tabi {t['candidate']}: test accuracy {t['accuracy']:.4f}, "
              f"{t['cost_ms']:.2f} ms; large alone {entry['test']['tabi-large']['accuracy']:.4f}, "
              f"{entry['test']['tabi-large']['cost_ms']:.2f} ms", flush=True)
        args.out.write_text(json.dumps(profile, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
