"""Tabi's offline profiling (§5): every cascade candidate of every text task, on validation, and the
chosen ones reported on test.

    jaxserve profile --cascade            (or: python -m training.profile_cascade)

Per task (``jaxserve.datasets.TEXT_TASKS``), with the calibrated heads of every encoder
(``training.train_cascade_heads`` writes them and their per-item probabilities):

1. **Costs.** Each model's batch-1 latency per length bucket, measured here on its jitted
   encoder (the function the servables compile), so a request's cost is its bucket's latency;
   a candidate's cost is the mean over the split with the expected routing
   (``jaxserve.sched.tabi.evaluate``).
2. **Candidates without pruning.** The chains of the issue (each model alone, L3/L6/bge ->
   MPNet, L3 -> bge -> MPNet, L3 -> L6 -> MPNet), each over the c sweep and k grid
   (``profile_candidates``), on validation; the cheapest meeting the target is the base.
3. **alpha.** §5 profiles pruning with extra runs "only for LLMs": the base's first model runs
   its importance executable (``make_encode_fn(..., importance=True)``) over the validation
   texts, and the items the base sends on with probability >= 1% are pruned at alpha = 0.5,
   0.6, ... and run by the later levels, until the cascade loses more than 2 points on those
   items; the last alpha within 2 points is kept (``profile_task``'s docstring).
4. **Selection.** The base's chain is re-profiled with that alpha; every candidate is kept in
   the profile; the default accuracy target is the largest model's validation accuracy minus
   0.5 points, met by a candidate's *assured* accuracy (its validation accuracy minus two
   standard errors of its paired difference from MPNet: ``jaxserve.sched.tabi``'s docstring). The cheapest candidate meeting it, each model alone and the INFaaS-like choice
   are evaluated on test with their validation weights (the chosen one on its pruned inputs).
5. **Replay.** ``jaxserve/assets/cascade/<task>-replay.npz``: the test split's per-item
   calibrated probabilities of every model on full and (per first model) pruned texts, and
   the token lengths, which ``jaxserve simulate --policy tabi`` replays.

Writes ``jaxserve/profiles/cascade.json`` (``jaxserve.sched.tabi.load_cascade_profile``).

Decision (the issue asks for the result "in the cost model"): the per-model latency profiles
(``jaxserve/profiles/<model>.json``) price cells at every batch size and are measured by
``jaxserve profile`` per model; a cascade's result is per *task* (its candidates, accuracies,
weights, alpha) and its costs are batch-1 bucket latencies measured in the same run as the
accuracies. So it is one file of its own beside them, and the cascade's cost model is built from
it (``jaxserve.launch.cascade_cost_model``: its ``bucket_ms`` as cells of batch 1), which is what
``simulate --policy tabi`` prices steps with. ``serve`` batches each level with the served models'
own cost profiles, as every policy does.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxserve.cascade import join_words, kept_words, truncated_text
from jaxserve.datasets import TEXT_TASKS, text_task_parts, text_task_split
from jaxserve.registry import ASSETS, PROFILES, TEXT_MODELS
from jaxserve.runtime import TaskHead
from jaxserve.sched.base import bucket_for_length
from jaxserve.sched.tabi import (LevelData, TaskProfile, choose, evaluate, pareto, profile_candidates,
                                 reach_probabilities, select)
from training.text_embeddings import EMBED_GRID, MAX_TOKENS, TextEmbedder, cached_embeddings

LARGE = "mpnet-base"
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

    def split_probabilities(self, task: str, split: str) -> np.ndarray:
        """The head's probabilities on a task's whole split, embedded part by part
        (``datasets.text_task_parts``: a composite task reuses its parts' cached features)."""
        feats = [cached_embeddings(self.embedder, texts, desc=f"{self.name} {task}/{part}/{split}")[0]
                 for part, texts, _ in text_task_parts(task, split) if texts]
        return self.head(task).probabilities(np.concatenate(feats))

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


REACH_FLOOR = 0.01  # items less likely than this to reach a later level keep their full-text outputs there
SWEEP_ITEMS = 400  # rerouted validation items the alpha sweep runs on (seeded sample)


def _pruned_outputs(enc: dict[str, Encoder], task: str, split_texts: list[str], first: str, later: tuple[str, ...],
                    alpha: float, rows: np.ndarray, importance, probs: dict, lengths: dict, desc: str):
    """Per later model, (probabilities [N, C], lengths [N]) with the items ``rows`` on ``first``'s
    pruned texts at ``alpha`` and every other item on its full text."""
    texts, imp = importance
    pruned = enc[first].pruned([texts[i] for i in rows], alpha, [imp[i] for i in rows])
    out = {}
    for m in later:
        p, n = probs[m].copy(), lengths[m].copy()
        if len(rows):
            p[rows] = enc[m].probabilities(task, pruned, f"{desc} pruned by {first} alpha={alpha:.1f}")
            n[rows] = enc[m].lengths(pruned)
        out[m] = (p, n)
    return out


def profile_task(task: str, enc: dict[str, Encoder], progress: bool = True) -> tuple[dict, dict]:
    """(the task's profile entry, its replay arrays).

    Pruning is profiled where it matters, as §5 does ("extra rounds of DNN inference only for
    LLMs"): the cheapest unpruned candidate meeting the target is selected first; alpha is then
    swept (0.5, 0.6, ...) on a seeded sample (``SWEEP_ITEMS``) of the validation items that
    candidate sends on with probability >= ``REACH_FLOOR``, pruned by its own first model, until
    the ensemble of its levels loses more than 2 points on them; the candidates of that chain
    are re-profiled with the chosen alpha (run on all those items) and the cheapest of all that
    meets the target is taken. Items below the floor keep their
    full-text outputs at the later levels (they practically never get there)."""
    split = {s: text_task_split(task, s)[:2] for s in ("val", "test")}
    labels_of = {s: split[s][1] for s in split}
    probs = {s: {m: e.split_probabilities(task, s) for m, e in enc.items()} for s in split}
    lengths = {s: {m: e.lengths(split[s][0]) for m, e in enc.items()} for s in split}
    data = {s: {m: LevelData(probs[s][m], enc[m].cost(lengths[s][m])) for m in enc} for s in split}
    labels = TEXT_TASKS[task].labels
    candidates = profile_candidates(task, [(m,) for m in enc] + list(CASCADES), data["val"], labels_of["val"],
                                    reference=LARGE)
    target = float((probs["val"][LARGE].argmax(1) == labels_of["val"]).mean()) - 0.005
    base = select(candidates, target)
    alpha, sweep, pruned_data, rebucket = None, [], {}, {}
    if len(base.levels) > 1:
        first, later = base.levels[0], base.levels[1:]
        reach = reach_probabilities(base.levels, base.thresholds, base.k, data["val"])[1]
        rows = np.flatnonzero(reach >= REACH_FLOOR)
        # the sweep runs on a seeded sample of those items (the large model's runs are what cost);
        # the chosen alpha then runs on all of them
        sample = np.sort(np.random.default_rng(0).permutation(rows)[:SWEEP_ITEMS])
        imp_val = enc[first].importance(split["val"][0], f"{task}/val")
        last = later[-1]

        def ensemble_accuracy(d, a):  # of the sample's answers, all of them rerouted
            mix = sum(w * (d[m].pruned_probabilities[a] if a is not None and j else d[m].probabilities)[sample]
                      for j, (m, w) in enumerate(zip(base.levels, base.weights[-1])))
            return float((mix.argmax(1) == labels_of["val"][sample]).mean())

        full_acc = ensemble_accuracy(data["val"], None)
        a = ALPHA_START
        while a < 3.0 and len(sample):
            a = round(a, 1)
            out = _pruned_outputs(enc, task, split["val"][0], first, later, a, sample, imp_val,
                                  probs["val"], lengths["val"], f"{task}/val sample")
            d = {m: LevelData(probs["val"][m], 0.0, {a: out[m][0]} if m in out else {}) for m in base.levels}
            acc = ensemble_accuracy(d, a)
            kept = float(out[last][1][sample].sum() / lengths["val"][last][sample].sum())
            sweep.append({"alpha": a, "items": int(len(sample)), "rerouted_accuracy_full": full_acc,
                          "rerouted_accuracy_pruned": acc, "token_share_kept": kept})
            print(f"{task}: alpha {a:.1f}: rerouted accuracy {acc:.4f} (full texts {full_acc:.4f}), "
                  f"tokens kept {kept:.3f}", flush=True)
            if full_acc - acc > ALPHA_MAX_LOSS:
                break
            alpha = a
            a += ALPHA_STEP
        if alpha is not None:
            out = _pruned_outputs(enc, task, split["val"][0], first, later, alpha, rows, imp_val,
                                  probs["val"], lengths["val"], f"{task}/val")
            pruned_data = dict(data["val"])
            for m, (p, n) in out.items():
                pruned_data[m] = LevelData(probs["val"][m], pruned_data[m].cost, {alpha: p}, {alpha: enc[m].cost(n)})
            candidates += profile_candidates(task, [base.levels], pruned_data, labels_of["val"], (alpha,),
                                             reference=LARGE)
    entry = TaskProfile(labels, target, tuple(candidates))
    chosen = select(candidates, target)

    test_data = dict(data["test"])
    replay = {"labels": labels_of["test"], "alpha": np.array(-1.0 if chosen.alpha is None else chosen.alpha)}
    pruned_share = None
    # the pruned candidate reported on test: the chosen one, or (when the cheapest is unpruned) the
    # cheapest pruned one meeting the target, so what pruning and re-bucketing do is measured either way
    pruned_pick = chosen if chosen.alpha is not None else min(
        (c for c in candidates if c.alpha is not None and c.assured >= target), key=lambda c: c.cost, default=None)
    if pruned_pick is not None:
        first, later = pruned_pick.levels[0], pruned_pick.levels[1:]
        reach = reach_probabilities(pruned_pick.levels, pruned_pick.thresholds, pruned_pick.k, data["test"])[1]
        rows = np.flatnonzero(reach >= REACH_FLOOR)
        imp_test = enc[first].importance(split["test"][0], f"{task}/test")
        out = _pruned_outputs(enc, task, split["test"][0], first, later, pruned_pick.alpha, rows, imp_test,
                              probs["test"], lengths["test"], f"{task}/test")
        for m, (p, n) in out.items():
            test_data[m] = LevelData(probs["test"][m], test_data[m].cost, {pruned_pick.alpha: p},
                                     {pruned_pick.alpha: enc[m].cost(n)})
            replay[f"probs/{m}|pruned-by|{first}"] = p.astype(np.float16)
            replay[f"length/{m}|pruned-by|{first}"] = n.astype(np.int16)
            rebucket[m] = {"rerouted_items": int(len(rows)),
                           "full_ms": enc[m].cost(lengths["test"][m][rows]) * 1e3,
                           "pruned_ms": enc[m].cost(n[rows]) * 1e3,
                           "tokens_kept": float(n[rows].sum() / lengths["test"][m][rows].sum())}
        pruned_share = 1.0 - rebucket[later[0]]["tokens_kept"]

    def on_test(c):
        pruned = pruned_pick is not None and c.alpha is not None and c.levels == pruned_pick.levels
        ev = evaluate(c.levels, c.thresholds, c.k, c.alpha if pruned else None, test_data if pruned else data["test"],
                      labels_of["test"], c.weights)
        return {"candidate": c.name(), "accuracy": ev["accuracy"], "cost_ms": ev["cost"] * 1e3,
                "exit_shares": ev["exit_shares"]}

    test = {p: on_test(choose(p, entry)) for p in ("tabi", "tabi-small", "tabi-large", "tabi-infaas", "tabi-cocktail")}
    test["singles"] = {m: on_test(next(c for c in candidates if c.levels == (m,))) for m in enc}
    test["unpruned"] = on_test(base)
    if pruned_pick is not None:
        test["pruned"] = on_test(pruned_pick)
    for m in enc:
        replay[f"probs/{m}"] = probs["test"][m].astype(np.float16)
        replay[f"length/{m}"] = lengths["test"][m].astype(np.int16)
    out = {"labels": list(labels), "target_accuracy": target, "alpha": alpha, "alpha_sweep": sweep,
           "rebucket_test": rebucket, "candidates": [c.to_json() for c in pareto(candidates)], "test": test,
           "pruned_token_share_test": pruned_share,
           "bucket_ms": {m: {str(b): t * 1e3 for b, t in e.bucket_seconds.items()} for m, e in enc.items()}}
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
