"""How do our AOT BERT executables compare with PyTorch eager and torch.compile on this CPU?

One question, one run: the same weights (MiniLM-L6 real weights; BERT-base random
weights exported to an HF directory so torch loads the identical tensors), the same
token ids and the same shapes (batch 8 and 32 x length 32..256), measured interleaved
so that every ratio compares timings taken in the same minutes of a shared machine.

  ours          PolymorphTable executables of jaxserve's encode fn (hidden states, mean
                pooling, L2 norm), compiled ahead of time per cell and tuned as
                ``--tune-attention`` tunes: YNN fusions on or off and, at <= 64 tokens,
                attention through the fused kernel or as XLA ops, the fastest kept (the
                options column names the winner)
  xla-attn      the same servable with attention traced as XLA ops in every cell
                (jaxserve.kernels.xla_attention; YNN tuned alike): what the kernel buys, as a
                same-minute ratio; where ours chose xla-attn itself, the same program
  eager         HF transformers BertModel, float32, inference_mode, the faster of
                attn_implementation="sdpa" and "eager" (both are shown)
  compile       torch.compile(dynamic=False) of the same encode function, default mode
  max-autotune  torch.compile(mode="max-autotune-no-cudagraphs"), only with --max-autotune

With --precision bf16 (jaxserve's opt-in reduced-precision mode, jaxserve/models/precision.py)
ours runs bf16 dense kernels with float32 accumulation, and every torch column runs under
torch.autocast("cpu", bfloat16), torch's own reduced-precision CPU mode: the ratios compare
like with like. A float32 torch eager column ("eager f32") shows what switching precision buys
over the float32 peer, and each cell's embeddings are compared with the float32 ones (our float32
executable, which matches torch's float32 to ~3e-7): minimum cosine per side. No 'xla-attn' column.

The torch side runs in the reference venv (.venv-ref, built by bench/setup_ref_env.sh)
as a long-lived worker (bench/_torch_worker.py) that answers JSON lines; jaxserve never
imports torch. Both sides get the same cores: JAX's thread pool spans the process's
CPU affinity and the worker calls torch.set_num_threads with that count (``--cores N``
pins both to the first N CPUs). The worker runs with OMP_WAIT_POLICY=PASSIVE: on a
shared machine libgomp's default spin-waiting made torch 3x slower at 2 threads (a
descheduled spinner stalls every parallel region), which would flatter us.

The float32 ceiling: bench/fma_peak.c, built with the system C compiler, runs register-only
FMA chains on every core, the most float32 arithmetic per second this CPU can do. Every
GFLOP/s column is also a share of it, and the goal check says in how many cells 1.3x eager
would take more than the CPU can do at all (same FLOPs, same precision).

Usage (from the repo root):
  .venv/bin/python -m bench.peer                      # full grid, markdown to stdout
  .venv/bin/python -m bench.peer --write              # ... and bench/results/peer.md
  .venv/bin/python -m bench.peer --models minilm --batches 8 --lengths 128 --rounds 3
  .venv/bin/python -m bench.peer --profile minilm:8x256   # per-thunk profile, ours vs xla-attn
  .venv/bin/python -m bench.peer --precision bf16 --write  # bf16 vs torch autocast: peer-bf16.md
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/peer.py", "bench/_torch_worker.py", "bench/fma_peak.c", "jaxserve/models", "jaxserve/kernels",
    "jaxserve/polymorph.py", "jaxserve/servables.py", "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {
    "peer": "--rounds 3 --cell-seconds 6 --write",
    "peer_bf16": "--precision bf16 --write",
}

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REF_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
WORKER = ROOT / "bench" / "_torch_worker.py"
RESULTS = ROOT / "bench" / "results" / "peer.md"
RESULTS_BF16 = ROOT / "bench" / "results" / "peer-bf16.md"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="minilm,bert-base")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--lengths", default="32,64,128,256")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per cell (at least)")
    p.add_argument("--cell-seconds", type=float, default=30.0,
                   help="keep adding rounds (up to 3x --rounds) while a cell has run less than this")
    p.add_argument("--min-seconds", type=float, default=0.4, help="per measurement: repeat calls up to this long")
    p.add_argument("--cores", type=int, default=0, help="pin both sides to the first N CPUs (0: all)")
    p.add_argument("--no-xla-attn", action="store_true", help="skip the column with attention as XLA ops")
    p.add_argument("--no-eager-eager", action="store_true", help="skip attn_implementation='eager'")
    p.add_argument("--max-autotune", default="", help="cells for max-autotune-no-cudagraphs, e.g. 'minilm:8x128' or 'all'")
    p.add_argument("--omp-wait-policy", default="PASSIVE", help="torch worker's OMP_WAIT_POLICY ('' = libgomp default)")
    p.add_argument("--profile", default="", help="MODEL:BxS -- per-thunk profile of ours vs xla-attn, then exit")
    p.add_argument("--precision", default="f32", choices=("f32", "bf16"),
                   help="bf16: ours with bf16 dense kernels vs torch under autocast bf16 (writes peer-bf16.md)")
    p.add_argument("--write", action="store_true",
                   help=f"also write {RESULTS.relative_to(ROOT)} ({RESULTS_BF16.relative_to(ROOT)} with --precision bf16)")
    from bench.common import add_quick, apply_quick

    add_quick(p, models="minilm", batches="8", lengths="32", rounds=1, cell_seconds=0.1, min_seconds=0.05,
              no_eager_eager=True)
    return apply_quick(p.parse_args(argv))


ARGS = parse_args()
if ARGS.cores:
    # before jax starts: XLA sizes its thread pools from the affinity mask
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: ARGS.cores]))
CORES = len(os.sched_getaffinity(0))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.common import bert_flops, bert_inputs, invocation, output, splice, stamp  # noqa: E402
from jaxserve import kernels  # noqa: E402
from jaxserve.models.bert import BERT_CONFIGS, BertConfig, export_hf_bert, init_bert, load_hf_bert, make_encode_fn  # noqa: E402
from jaxserve.polymorph import TUNE_ATTENTION, PolymorphTable, options_label  # noqa: E402
from jaxserve.registry import minilm_dir  # noqa: E402
from jaxserve.sched.base import Cell, ShapeGrid  # noqa: E402
from jaxserve.servables import bert_servable, weights_of  # noqa: E402


# ----------------------------------------------------------------------- model side

def load_model(name: str, tmp: Path):
    """(cfg, model, hf_dir): MiniLM's real checkpoint, or BERT-base random weights exported."""
    if name == "minilm":
        d = minilm_dir()
        cfg, model = load_hf_bert(d)
        return cfg, model, d
    cfg = BERT_CONFIGS[name]
    model = init_bert(cfg, seed=0)
    d = tmp / name
    export_hf_bert(model, d)
    return cfg, model, d


# ----------------------------------------------------------------------- torch worker

class TorchWorker:
    def __init__(self, cores: int, omp_wait_policy: str, inductor_dir: str):
        env = dict(os.environ, PEER_TORCH_THREADS=str(cores), OMP_NUM_THREADS=str(cores),
                   TORCHINDUCTOR_CACHE_DIR=inductor_dir)  # a fresh dir: compile times are cold
        env.pop("OMP_WAIT_POLICY", None)
        if omp_wait_policy:
            env["OMP_WAIT_POLICY"] = omp_wait_policy
        env.pop("XLA_FLAGS", None)
        self.proc = subprocess.Popen([str(REF_PYTHON), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL if not os.environ.get("PEER_DEBUG") else None,
                                     text=True, env=env, cwd=str(ROOT))

    def call(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("torch worker died (rerun with PEER_DEBUG=1 to see its stderr)")
        return json.loads(line)

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


# ----------------------------------------------------------------------- measuring

def timed_calls(fn, min_seconds: float) -> tuple[list[float], list[float]]:
    """Call fn (blocking) at least once and until min_seconds have passed.

    Returns per-call wall seconds and per-call process CPU seconds (all threads). CPU time
    is what a call cost, whatever share of the cores the other tenants left us; wall time
    is what a client waits."""
    wall, cpu = [], []
    start = time.perf_counter()
    while True:
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if time.perf_counter() - start >= min_seconds:
            return wall, cpu


def matmul_gflops(fn, n: int = 2048, reps: int = 5) -> tuple[list[float], list[float]]:
    """GFLOP/s of an n^3 float32 matmul: per wall second and per CPU second."""
    fn()
    f = 2 * n**3 / 1e9
    wall, cpu = [], []
    for _ in range(reps):
        w, c = timed_calls(fn, 0.0)
        wall.append(f / w[0])
        cpu.append(f / max(c[0], 1e-9))
    return wall, cpu


def jax_matmul(n: int = 2048):
    a = jnp.asarray(np.random.rand(n, n).astype(np.float32))
    f = jax.jit(jnp.dot).lower(a, a).compile()
    return lambda: f(a, a).block_until_ready()


def fma_ceiling(build_dir: Path, runs: int = 3) -> float:
    """GFLOP/s of bench/fma_peak.c on this process's cores: the CPU's float32 ceiling (best of
    ``runs``: other tenants can only lower it). NaN without a C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return math.nan
    exe = build_dir / "fma_peak"
    if not exe.exists():
        subprocess.run([cc, "-O3", "-march=native", "-ffp-contract=fast", "-pthread",
                        str(ROOT / "bench" / "fma_peak.c"), "-o", str(exe)], check=True, capture_output=True)
    out = [subprocess.run([str(exe), str(CORES)], capture_output=True, text=True, check=True).stdout.split()
           for _ in range(runs)]
    return max(float(o[2]) for o in out)


def numpy_matmul(n: int = 2048):
    a = np.random.rand(n, n).astype(np.float32)
    return lambda: a @ a


@dataclass
class CellResult:
    model: str
    batch: int
    seq: int
    flops: float
    times: dict[str, list[float]] = field(default_factory=dict)  # impl -> per-call wall seconds
    cpu: dict[str, list[float]] = field(default_factory=dict)  # impl -> per-call CPU seconds
    round_medians: dict[str, list[float]] = field(default_factory=dict)  # impl -> per-round wall medians
    round_cpu: dict[str, list[float]] = field(default_factory=dict)  # impl -> per-round CPU medians
    first: dict[str, float] = field(default_factory=dict)  # impl -> seconds to first result
    compile_only: float = 0.0  # jax: the table's warmup of the cell (tuning included), seconds
    options: str = ""  # jax: the compile options warmup's tuning kept (polymorph.options_label)
    parity: dict[str, float] = field(default_factory=dict)  # impl -> max |embedding - ours|
    cos_f32: dict[str, float] = field(default_factory=dict)  # --precision bf16: impl -> min cosine to float32
    errors: dict[str, str] = field(default_factory=dict)

    def median_ms(self, impl: str) -> float:
        return float(np.median(self.times[impl])) * 1e3 if self.times.get(impl) else math.nan

    def cpu_ms(self, impl: str) -> float:
        return float(np.median(self.cpu[impl])) * 1e3 if self.cpu.get(impl) else math.nan

    def speedup(self, impl: str, metric: str = "wall") -> float:
        """Median over rounds of (impl / ours), each round's pair measured back to back."""
        rounds = self.round_medians if metric == "wall" else self.round_cpu
        a, b = rounds.get(impl), rounds.get("ours")
        if not a or not b:
            return math.nan
        return float(np.median(np.array(a) / np.array(b)))


def run_grid(args, worker: TorchWorker, models: list[str], batches, lengths, tmp: Path, log) -> tuple[list, dict]:
    results: list[CellResult] = []
    info: dict = {}
    autotune_cells = set(args.max_autotune.split(",")) if args.max_autotune else set()
    bf16 = args.precision == "bf16"
    autocast = "bf16" if bf16 else ""
    for name in models:
        cfg, model, hf_dir = load_model(name, tmp)
        r = worker.call(cmd="load", model=name, dir=str(hf_dir))
        if "error" in r:
            raise RuntimeError(f"torch worker could not load {name}: {r['error']}")
        info["torch"] = r
        if "init" not in info:
            # one-time process costs (backend start, importing inductor, first C++ build)
            # land here, not on the first cell of the table
            ids, mask = bert_inputs(cfg, 1, 8)
            t0 = time.perf_counter()
            gd, st = nnx.split(model)
            jax.block_until_ready(jax.jit(make_encode_fn(gd)).lower(st, ids, mask).compile()(st, ids, mask))
            j = time.perf_counter() - t0
            r = worker.call(cmd="setup", impl="compile-default", model=name, ids=ids.tolist(), mask=mask.tolist())
            worker.call(cmd="drop", impl="compile-default", model=name, batch=1, seq=8)
            info["init"] = (j, r.get("first_seconds", math.nan))
        grid = ShapeGrid(batch_sizes=tuple(batches), seq_buckets=tuple(lengths))
        table = PolymorphTable(bert_servable(name, cfg, grid, args.precision), tune=TUNE_ATTENTION)
        weights = weights_of(model, args.precision)
        if bf16:  # float32 reference embeddings: our float32 executables (== torch float32 to ~3e-7)
            ref_table, ref_weights = PolymorphTable(bert_servable(name, cfg, grid)), weights_of(model)
        # the same servable, its attention traced as XLA ops (every trace inside xla_attention())
        xla_table = PolymorphTable(bert_servable(name, cfg, grid, args.precision))
        for b in batches:
            for s in lengths:
                cell = Cell(b, s)
                res = CellResult(name, b, s, bert_flops(cfg, b, s))
                ids, mask = bert_inputs(cfg, b, s)
                # ---- first results (per-shape compile) ----
                t0 = time.perf_counter()
                row = table.warm_cell(cell)
                out = table.run(cell, weights, ids, mask)
                res.first["ours"] = time.perf_counter() - t0
                res.compile_only = row.compile_seconds
                res.options = options_label(row.compile_options)
                ours_emb = out["embedding"]
                calls = {"ours": lambda cell=cell, ids=ids, mask=mask: table.run(cell, weights, ids, mask)}
                if bf16:
                    ref_table.warm_cell(cell)
                    ref_emb = ref_table.run(cell, ref_weights, ids, mask)["embedding"]
                    res.cos_f32["ours"] = float((ours_emb * ref_emb).sum(-1).min())
                if not args.no_xla_attn and not bf16:
                    t0 = time.perf_counter()
                    with kernels.xla_attention():
                        xla_table.warm_cell(cell)
                    emb = xla_table.run(cell, weights, ids, mask)["embedding"]
                    res.first["xla-attn"] = time.perf_counter() - t0
                    res.parity["xla-attn"] = float(np.abs(emb - ours_emb).max())
                    calls["xla-attn"] = lambda cell=cell, ids=ids, mask=mask: xla_table.run(cell, weights, ids, mask)
                impls = ["eager-sdpa"] + ([] if args.no_eager_eager else ["eager-eager"]) + ["compile-default"]
                if bf16:
                    impls.append("f32:eager-sdpa")
                if "all" in autotune_cells or f"{name}:{b}x{s}" in autotune_cells:
                    impls.append("compile-max-autotune")
                for impl in impls:
                    r = worker.call(cmd="setup", impl=impl, model=name, ids=ids.tolist(), mask=mask.tolist(),
                                    autocast=autocast)
                    if "error" in r:
                        res.errors[impl] = r["error"]
                        log(f"  {name} b{b} s{s} {impl}: ERROR {r['error'][:200]}")
                        continue
                    res.first[impl] = r["first_seconds"]
                    emb = np.asarray(r["embedding"], np.float32)
                    res.parity[impl] = float(np.abs(emb - ours_emb).max())
                    if bf16:
                        res.cos_f32[impl] = float((emb * ref_emb).sum(-1).min())
                    calls[impl] = impl
                # ---- interleaved timing: every round measures every impl back to back ----
                order = list(calls)
                cell_start = time.perf_counter()
                rnd = 0
                while rnd < args.rounds or (rnd < 3 * args.rounds and time.perf_counter() - cell_start < args.cell_seconds):
                    rot = order[rnd % len(order):] + order[: rnd % len(order)]
                    for impl in rot:
                        c = calls[impl]
                        if isinstance(c, str):
                            # torch: size reps from the last median so one measurement ~ min_seconds
                            last = res.round_medians.get(impl, [None])[-1]
                            reps = 1 if last is None else max(1, min(20, int(args.min_seconds / max(last, 1e-4))))
                            r = worker.call(cmd="time", impl=impl, model=name, batch=b, seq=s, reps=reps)
                            secs, cpu = r["seconds"], r["cpu_seconds"]
                        else:
                            secs, cpu = timed_calls(c, args.min_seconds)
                        res.times.setdefault(impl, []).extend(secs)
                        res.cpu.setdefault(impl, []).extend(cpu)
                        res.round_medians.setdefault(impl, []).append(float(np.median(secs)))
                        res.round_cpu.setdefault(impl, []).append(float(np.median(cpu)))
                    rnd += 1
                for impl in impls:
                    worker.call(cmd="drop", impl=impl, model=name, batch=b, seq=s)
                results.append(res)
                log(f"  {name} b{b} s{s} ({rnd} rounds): " + ", ".join(
                    f"{k} {res.median_ms(k):.1f}ms/{res.cpu_ms(k):.0f}cpu-ms" for k in res.times))
        del table, xla_table, model, weights
    return results, info


# ----------------------------------------------------------------------- reporting

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fmt(x, spec=".1f", dash="–"):
    return dash if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report(args, results: list[CellResult], peaks: dict, info: dict, started: str, seconds: float) -> str:
    peak_w = max(float(np.median(w)) for w, _ in peaks.values() if w)
    peak_c = max(float(np.median(c)) for _, c in peaks.values() if c)
    torch_info = info.get("torch", {})
    bf16 = args.precision == "bf16"
    L = []
    L.append("# Peer benchmark: jaxserve AOT executables vs PyTorch eager and torch.compile"
             + (" -- bf16 (ours --precision bf16, torch under autocast bf16)\n" if bf16 else "\n"))
    L.append(f"- command: `{' '.join(shlex.quote(a) for a in [sys.executable.replace(str(ROOT) + '/', ''), *invocation()])}`")
    L.append(f"- date: {started} (run took {seconds / 60:.1f} min)")
    L.append(f"- machine: {cpu_model()}, {os.cpu_count()} CPUs visible, both sides on {CORES} "
             f"(JAX: XLA thread pool over the affinity mask; torch.set_num_threads({torch_info.get('threads')}), "
             f"OMP_WAIT_POLICY={torch_info.get('omp_wait_policy') or 'default'}). Shared with other jobs: "
             f"load average {info.get('load_start')} at start, {info.get('load_end')} at end")
    L.append(f"- jax {jax.__version__}, XLA_FLAGS='{os.environ.get('XLA_FLAGS', '')}', attention "
             f"{kernels.attention_fingerprint()} (jaxserve.kernels); torch {torch_info.get('torch')}, "
             f"transformers {info.get('transformers', '?')}; "
             + ("ours: bf16 dense kernels, float32 accumulation, everything else float32 (jaxserve/models/precision.py); "
                "torch: torch.autocast('cpu', dtype=torch.bfloat16) around the whole encode fn, eager and compiled; "
                "'eager f32' is torch eager (sdpa) in float32."
                if bf16 else "float32 everywhere"))
    L.append("- matmul 2048x2048 float32, GFLOP/s per wall second / per CPU second (median of checks before and "
             "after the grid): " + ", ".join(f"{k} {np.median(w):.0f} / {np.median(c):.0f}" for k, (w, c) in peaks.items() if w)
             + f". Peak = the best: {peak_w:.0f} GFLOP/s, {peak_c:.0f} GFLOP per CPU-second.")
    L.append(f"- timing: per cell, >= {args.rounds} interleaved rounds (more while the cell has run < {args.cell_seconds:.0f}s); "
             f"every round measures every implementation back to back, rotating the order, repeating calls for "
             f">= {args.min_seconds}s. ms = median wall time per call. Speedups (>1: ours is faster) = median over rounds "
             "of the same-round ratio, on wall time and, in brackets, on process CPU time per call (all threads): "
             "CPU time is what a call cost whatever share of the cores the other tenants left, so it is the steadier "
             "figure on this shared machine.")
    L.append("- same weights and token ids on both sides (MiniLM: the real all-MiniLM-L6-v2 checkpoint; "
             "BERT-base: random init exported with export_hf_bert); the last row of every batch is half padding."
             + (" Ours is tuned per cell as `--tune-attention` tunes (YNN fusions on/off; at <= 64 tokens also "
                "attention through the fused kernel or as XLA ops): the options in brackets won. 'xla-attn' is the "
                "same servable with attention as XLA ops in every cell (YNN tuned alike), for the before/after of "
                "the kernel; where ours chose xla-attn, the two run the same program.\n"
                if any("xla-attn" in r.times for r in results) else "\n"))
    fma = info.get("fma_gflops", math.nan)
    if not bf16:
        L.append(f"- float32 FMA ceiling (bench/fma_peak.c: register-only FMA chains on the {CORES} cores, best of "
                 f"the runs before and after the grid): {fmt(fma, '.0f')} GFLOP/s; the best 2048x2048 matmul reaches "
                 f"{fmt(100 * peak_w / fma, '.0f')}% of it. '1.3x eager needs' is 1.3 x eager's GFLOP/s as a share "
                 "of that ceiling: over 100% no float32 implementation doing the same arithmetic can reach.\n")
    has_xla_attn = any("xla-attn" in r.times for r in results)
    has_ma = any("compile-max-autotune" in r.times for r in results)
    head = ["model", "B", "S", "ours ms (options)", "eager ms (impl)", "compile ms"] + (["max-autotune ms"] if has_ma else [])
    head += ["ours/eager", "ours/compile"] + (["ours/xla-attn"] if has_xla_attn else [])
    if bf16:
        head += ["eager f32 ms", "ours/eager f32", "GFLOP/s ours / eager / compile",
                 "min cos to float32: ours / eager / compile"]
    else:
        head += ["GFLOP/s ours / eager / compile (% of peak)", "GFLOP per CPU-s ours / compile (% of peak)",
                 "1.3x eager needs", "max |Δemb| vs eager"]
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "---|" * len(head))
    sp = lambda r, k: f"{fmt(r.speedup(k), '.2f')}× ({fmt(r.speedup(k, 'cpu'), '.2f')}×)"  # noqa: E731
    for r in results:
        best_eager = _best_eager(r)
        gw = lambda impl: r.flops / (r.median_ms(impl) / 1e3) / 1e9 if r.times.get(impl) else math.nan  # noqa: E731
        gc = lambda impl: r.flops / (r.cpu_ms(impl) / 1e3) / 1e9 if r.cpu.get(impl) else math.nan  # noqa: E731
        row = [r.model, str(r.batch), str(r.seq), f"{fmt(r.median_ms('ours'))} ({r.options or '?'})",
               f"{fmt(r.median_ms(best_eager))} ({best_eager.replace('eager-', '')})" if best_eager else "–",
               fmt(r.median_ms("compile-default"))]
        if has_ma:
            row.append(fmt(r.median_ms("compile-max-autotune")) if r.times.get("compile-max-autotune")
                       else ("err" if "compile-max-autotune" in r.errors else "–"))
        row += [sp(r, best_eager) if best_eager else "–", sp(r, "compile-default")]
        if has_xla_attn:
            row.append(sp(r, "xla-attn"))
        if bf16:
            row += [fmt(r.median_ms("f32:eager-sdpa")), sp(r, "f32:eager-sdpa")]
        row.append(" / ".join(fmt(gw(k), ".0f") for k in ("ours", best_eager or "", "compile-default"))
                   + ("" if bf16 else  # a float32 peak is no yardstick for bf16 dots
                      f" ({' / '.join(fmt(100 * gw(k) / peak_w, '.0f') for k in ('ours', best_eager or '', 'compile-default'))}%)"))
        if bf16:
            row.append(" / ".join(fmt(r.cos_f32.get(k, math.nan), ".6f") for k in ("ours", best_eager or "", "compile-default")))
        else:
            row.append(" / ".join(fmt(gc(k), ".0f") for k in ("ours", "compile-default"))
                       + f" ({' / '.join(fmt(100 * gc(k) / peak_c, '.0f') for k in ('ours', 'compile-default'))}%)")
            row.append(f"{fmt(130 * gw(best_eager) / fma, '.0f')}% of FMA" if best_eager else "–")
            row.append(fmt(r.parity.get(best_eager, math.nan), ".1e") if best_eager else "–")
        L.append("| " + " | ".join(row) + " |")
    L.append("")
    for metric, label in (("wall", "wall time"), ("cpu", "CPU time")):
        e = [r.speedup(_best_eager(r), metric) for r in results if _best_eager(r)]
        c = [r.speedup("compile-default", metric) for r in results]
        n = [r.speedup("xla-attn", metric) for r in results] if has_xla_attn else []
        what = "bf16 vs torch autocast bf16, " if bf16 else ""
        L.append(f"- **Goal check on {label}** ({what}ours >= 1.3x eager and >= 1.0x torch.compile, B in {{8, 32}}, S 32-256): "
                 f">= 1.3x eager in {sum(x >= 1.3 for x in e)}/{len(e)} cells, >= 1.0x compile in "
                 f"{sum(x >= 1.0 for x in c)}/{len(c)} cells; geometric means ours/eager {_gmean(e):.2f}x, "
                 f"ours/compile {_gmean(c):.2f}x" + (f", ours/xla-attn {_gmean(n):.2f}x." if n else "."))
    if not bf16 and fma == fma:
        need = [1.3 * r.flops / (r.median_ms(_best_eager(r)) / 1e3) / 1e9 / fma for r in results if _best_eager(r)]
        L.append(f"- **What 1.3x eager asks of this CPU**: more float32 arithmetic per second than its FMA ceiling in "
                 f"{sum(x > 1.0 for x in need)}/{len(need)} cells, >= 90% of it in {sum(x >= 0.9 for x in need)}/{len(need)} "
                 f"(the best 2048x2048 matmul reaches {100 * peak_w / fma:.0f}%); eager itself runs at "
                 f"{100 * min(need) / 1.3:.0f}-{100 * max(need) / 1.3:.0f}% of the ceiling.")
    if bf16:
        f = [r.speedup("f32:eager-sdpa") for r in results]
        L.append(f"- **ours bf16 vs torch eager float32** (what switching precision buys over the float32 peer): "
                 f">= 1.3x in {sum(x >= 1.3 for x in f)}/{len(f)} cells, geometric mean {_gmean(f):.2f}x; min cosine to "
                 f"float32 over all cells: ours {min(r.cos_f32.get('ours', 1.0) for r in results):.6f}, torch eager "
                 f"autocast {min(r.cos_f32.get(_best_eager(r) or '', 1.0) for r in results):.6f}.")
    if any(r.times.get("eager-eager") for r in results):
        L.append("- 'eager' is the faster of attn_implementation sdpa / eager per cell (ms): "
                 + "; ".join(f"{r.model} {r.batch}x{r.seq} {r.median_ms('eager-sdpa'):.0f}/{r.median_ms('eager-eager'):.0f}"
                             for r in results if r.times.get("eager-eager")) + ".")
    L.append("\n## Grid warmup: time to first result per shape (seconds)\n")
    L.append("JAX: the polymorph table's warmup of the cell: `jit(...).lower(...).compile()` of each candidate set of "
             "options (YNN fusions on / off, bf16: all or single dots; at <= 64 tokens each also with attention as XLA ops), timing them and keeping the fastest ('JAX compile' includes that "
             "tuning), then the first call. "
             "torch.compile(dynamic=False): a fresh wrapper per shape, the first call (dynamo + inductor, "
             "inductor cache cold at the start of the run). Eager: the first call.\n")
    head = ["model", "B", "S", "JAX compile", "JAX first result", "torch.compile first result", "eager first result"]
    if has_ma:
        head.append("max-autotune first result")
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "---|" * len(head))
    tot = {"jc": 0.0, "jf": 0.0, "tc": 0.0}
    for r in results:
        row = [r.model, str(r.batch), str(r.seq), fmt(r.compile_only, ".2f"), fmt(r.first.get("ours"), ".2f"),
               fmt(r.first.get("compile-default"), ".1f"), fmt(r.first.get("eager-sdpa"), ".2f")]
        if has_ma:
            row.append(fmt(r.first.get("compile-max-autotune"), ".1f"))
        tot["jc"] += r.compile_only
        tot["jf"] += r.first.get("ours", 0.0)
        tot["tc"] += r.first.get("compile-default", 0.0)
        L.append("| " + " | ".join(row) + " |")
    if "init" in info:
        L.append(f"\nBefore the grid, each side compiled a throwaway 1x8 cell so one-time process costs "
                 f"are not charged to the first shape: JAX {info['init'][0]:.1f}s, torch.compile {info['init'][1]:.1f}s.")
    L.append(f"\nWhole grid: JAX {tot['jc']:.1f}s of compiles ({tot['jf']:.1f}s to all first results, which include "
             f"running each shape once) vs torch.compile {tot['tc']:.1f}s to all first results "
             f"({tot['tc'] / max(tot['jf'], 1e-9):.1f}x).")
    errs = [(r, k, v) for r in results for k, v in r.errors.items()]
    if errs:
        L.append("\nErrors: " + "; ".join(f"{r.model} {r.batch}x{r.seq} {k}: {v[:160]}" for r, k, v in errs))
    return "\n".join(L) + "\n"


def results_section(md: str, key: str) -> str:
    """The report as a bench/RESULTS.md section: its title, the common stamp (bench.common.stamp),
    then the report's own lines (they add the load average, torch's versions, the timing)."""
    body = md.strip().replace("\n## ", "\n### ")
    title, _, rest = body.partition("\n")
    return f"<!-- bench:{key} -->\n#{title}\n\n{stamp()}\n{rest}\n<!-- /bench:{key} -->"


def _best_eager(r: CellResult) -> str | None:
    """The faster torch eager variant of the cell (by median wall time)."""
    eag = {k: r.median_ms(k) for k in ("eager-sdpa", "eager-eager") if r.times.get(k)}
    return min(eag, key=eag.get) if eag else None


def _gmean(xs) -> float:
    xs = [x for x in xs if x == x and x > 0]
    return float(np.exp(np.mean(np.log(xs)))) if xs else math.nan


# ----------------------------------------------------------------------- profiling

def profile(spec: str) -> str:
    """Per-thunk wall time of one cell's executable, grouped by what each thunk computes.

    Uses jax.profiler: on XLA:CPU every thunk (a fused kernel, a library dot, a YNNPACK
    fusion) is one trace event; the optimized HLO (compiled.as_text()) says what each
    named thunk contains, so events are grouped into dense matmuls, attention, GELU, ...
    """
    import collections
    import glob
    import re

    name, shape = spec.split(":")
    b, s = map(int, shape.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        cfg, model, _ = load_model(name, Path(tmp))
    graphdef, state = nnx.split(model)
    ids, mask = bert_inputs(cfg, b, s)
    from jaxserve.servables import bert_options

    out = [f"# per-thunk profile: {name} B={b} S={s}, {CORES} cores, jax {jax.__version__}\n"]
    options = bert_options(Cell(b, s)) or None  # ours compiles as the polymorph table would
    for label in ("ours", "xla-attn"):
        with kernels.xla_attention() if label == "xla-attn" else contextlib.nullcontext():
            c = jax.jit(make_encode_fn(graphdef)).lower(state, ids, mask).compile(compiler_options=options)
        hlo = c.as_text()
        comps = {m.group(1): m.group(2) for m in re.finditer(r"^%(\S+) .*?\{\n(.*?)\n\}", hlo, re.S | re.M)}
        kind = {}
        for line in hlo.splitlines():
            m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) ([\w-]+)\(", line)
            if not m:
                continue
            nm, shp, op = m.groups()
            called = re.search(r"calls=%([\w.\-]+)", line)
            ops = set(re.findall(r"= \S+ ([a-z][\w-]*)\(", comps.get(called.group(1), ""))) if called else set()
            shp = shp.split("{")[0]
            if op == "custom-call" or "custom-call" in ops:
                kind[nm] = "fused attention kernel " + shp
            elif "dot" in ops and "exponential" in ops:
                kind[nm] = "attention fusion (dot+softmax+dot) " + shp
            elif op == "dot" or "dot" in ops:
                kind[nm] = "dot " + shp
            elif "erf" in ops or ("exponential" in ops and "divide" in ops and "abs" in ops):
                kind[nm] = "GELU " + shp
            elif op == "fusion":
                core = sorted(ops - {"parameter", "bitcast", "broadcast", "constant"})
                kind[nm] = ("reduce " if {"reduce", "reduce-window"} & ops else "loop ") + "+".join(core)[:50] + " " + shp
            else:
                kind[nm] = op + " " + shp
        for _ in range(2):
            jax.block_until_ready(c(state, ids, mask))
        wall = timed_calls(lambda: jax.block_until_ready(c(state, ids, mask)), 1.0)
        n = 3
        with tempfile.TemporaryDirectory() as tdir:
            with jax.profiler.trace(tdir):
                for _ in range(n):
                    jax.block_until_ready(c(state, ids, mask))
            pb = glob.glob(tdir + "/**/*.xplane.pb", recursive=True)[0]
            pd = jax.profiler.ProfileData.from_file(pb)
        agg, cnt = collections.defaultdict(float), collections.Counter()
        for plane in pd.planes:
            for line in plane.lines:
                for ev in line.events:
                    if ev.name in kind:
                        agg[kind[ev.name]] += ev.duration_ns / n / 1e6
                        cnt[kind[ev.name]] += 1
        total = sum(agg.values())
        out.append(f"## {label}: median wall {np.median(wall) * 1e3:.1f} ms; thunk time {total:.1f} ms "
                   "(library dots run on the caller thread and are timed whole; on >1 core, "
                   "Eigen dots are only timed to their dispatch)\n")
        out.append("| ms/run | share | thunks/run | what |\n|---|---|---|---|")
        for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:18]:
            out.append(f"| {v:.1f} | {100 * v / total:.1f}% | {cnt[k] / n:.0f} | {k} |")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------- main

def main():
    args = ARGS
    log = lambda *a: print("[peer]", *a, file=sys.stderr, flush=True)  # noqa: E731
    if args.profile:
        print(profile(args.profile))
        return
    if not REF_PYTHON.exists():
        sys.exit(f"{REF_PYTHON} is missing: run `bash bench/setup_ref_env.sh` first")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t_start = time.perf_counter()
    models = args.models.split(",")
    batches = [int(x) for x in args.batches.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory(prefix="peer-") as tmp:
        worker = TorchWorker(CORES, args.omp_wait_policy, str(Path(tmp) / "inductor"))
        try:
            info = {"load_start": " ".join(f"{x:.1f}" for x in os.getloadavg())}
            peaks = {k: ([], []) for k in ("jax jnp.dot", "torch", "numpy")}  # (wall, per-cpu-second)
            jm, nm = jax_matmul(), numpy_matmul()

            def measure_peaks():
                info["fma_gflops"] = max(info.get("fma_gflops", 0.0), fma_ceiling(Path(tmp)))
                for key, fn in (("jax jnp.dot", jm), ("numpy", nm)):
                    w, c = matmul_gflops(fn)
                    peaks[key][0].extend(w)
                    peaks[key][1].extend(c)
                r = worker.call(cmd="matmul", n=2048, reps=5)
                peaks["torch"][0].extend(r["gflops"])
                peaks["torch"][1].extend(r["gflops_per_cpu_second"])

            measure_peaks()
            log("matmul GFLOP/s so far (wall, per cpu-s):",
                {k: (round(float(np.median(w))), round(float(np.median(c)))) for k, (w, c) in peaks.items()})
            results, winfo = run_grid(args, worker, models, batches, lengths, Path(tmp), log)
            info.update(winfo)
            measure_peaks()
            info["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
            try:
                info["transformers"] = subprocess.run(
                    [str(REF_PYTHON), "-c", "import transformers; print(transformers.__version__)"],
                    capture_output=True, text=True, timeout=60).stdout.strip()
            except Exception:
                pass
        finally:
            worker.close()
    md = report(args, results, peaks, info, started, time.perf_counter() - t_start)
    print(md)
    if args.write:
        out = output(RESULTS_BF16 if args.precision == "bf16" else RESULTS)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
        written = splice(results_section(md, "peer_bf16" if args.precision == "bf16" else "peer"))
        log(f"wrote {out} and its section in {written}")


if __name__ == "__main__":
    main()
