"""How many requests per minute of wall time can the simulator push through each policy?

Times :func:`jaxserve.simulator.simulate` for every policy ``jaxserve simulate --policy P``
serves one model with, each built as that command builds it (:func:`jaxserve.launch.make_policy`
over :func:`~jaxserve.launch.simulated_models`), at 1, 100 and 1000 instances; the goal is
>= 1,000,000 simulated requests per minute for every (policy, instances) cell.

* ``default`` (DeadlineBatching), ``arlo``, ``st``, ``dt``, ``infaas``: the MiniLM-L6 serve
  profile (bench/results/sim_knee-cost_model.json, the cost model the server profiled on
  this machine), Poisson arrivals of real tweet lengths (MiniLM tokenizer, clipped to the
  grid's longest bucket), every request with the paper-scaled Arlo SLO
  (``baselines.paper_scaled_slo``: 30.9 x the batch-1 price of the longest bucket). Serve
  settings otherwise: max_wait 0, max_queue 256 per instance, Arlo period 120 s,
  ST/DT/INFaaS at batch 1 (the paper's), Arlo's max batch from the profile, DT penalty 1.22.
* ``otas``: the demo ViT's OTAS profile (bench/otas_cost_vit-demo.json: latency per (gamma,
  batch), accuracy per (task, gamma)) scaled as bench/otas_utility.py scales it (gamma 0 at
  the largest batch serves 580 req/s), OTAS Table II's six query types uniformly.

Load: each cell's Poisson rate is ``--load`` (default 0.7) x instances x one instance's
capacity *under that policy*: its batch size at each request's length (default and OTAS:
the grid's largest; Arlo: each runtime's from the profile; ST/DT/INFaaS: 1), in the
executable the policy runs it in (default/Arlo/INFaaS: the request's bucket; ST: the
longest bucket; DT: its exact length x the penalty; OTAS: gamma 0), averaged over the
lengths. The table also shows the utilisation the run reached (busy instance-seconds).
Every cell then runs again at ``--overload`` (default 1.3) of that capacity: queues fill to
``max_queue``, requests are evicted, and OTAS's Alg. 2 must trade batches off, so its DP runs
where below capacity the all-best shortcut answers (those rows skip the full-DP arms).

OTAS in steady state: each OTAS policy is told its run began ``initial_stage`` (2 s) before
the trace (``OTASPolicy.start_time``), so it plans by Alg. 2 from the first plan, wherever the
paper's rule picks Alg. 2 (more than ``beta`` queued batches), as it does for all but the first
2 s of any run. Decision: a run's first 2 s use Alg. 3 alone, which costs a fraction of Alg. 2's
DP, and a trace that sizes itself by wall time stayed in them for most of its span (at 1,000
instances entirely: 0.3 virtual s), so the rows measured the cheap transient and moved with how
far past it each trace reached. The queue still starts empty, and the arrival-rate window
(1 s, which Alg. 3 reads) fills over the trace's first second.

Timing: wall time of ``simulate`` alone (trace and policy are built before the clock
starts). A pilot run of ``--pilot`` requests sizes each cell so one run takes about
``--seconds``; the cell then runs ``--repeats`` times on the same trace (a fresh policy
each time) and the median is reported. OTAS answers Alg. 2 without its DP where no trade-off is
needed (``OTASParams.all_best_shortcut``, provably the DP's own answer: jaxserve.sched.otas); the
table counts the plans it answered. Each OTAS cell's trace also runs once with the whole DP at
every plan, in native code and in Python/numpy (``JAXSERVE_NATIVE_DP=0``; skip both with
``--no-full-dp``, the numpy one with ``--no-numpy-dp``), and each result is compared with the
shortcut's array by array: the shortcut's and the native DP's speed-ups in the same run.

    .venv/bin/python -m bench.sim_speed [--seconds 5] [--repeats 3] [--no-full-dp] [--no-numpy-dp] [--write]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/sim_speed.py", "bench/results/sim_knee-cost_model.json", "bench/otas_cost_vit-demo.json",
    "jaxserve/simulator.py", "jaxserve/launch.py", "jaxserve/sched/base.py", "jaxserve/sched/batching.py",
    "jaxserve/sched/arlo", "jaxserve/sched/baselines.py", "jaxserve/sched/otas.py", "jaxserve/traces.py",
    "jaxserve/kernels/otas_dp.c", "jaxserve/kernels/__init__.py",
)
SECTIONS = {"sim_speed": "--write"}

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve import traces
from jaxserve.launch import ServeSettings, make_policy, simulated_models
from jaxserve.profiler import load_cost_model
from jaxserve.sched import baselines
from jaxserve.sched.base import Cell, CostModel, bucket_for_length
from jaxserve.simulator import OK, simulate

BENCH = Path(__file__).resolve().parent
TEXT_PROFILE = BENCH / "results" / "sim_knee-cost_model.json"
TEXT_MODEL = "minilm-l6"
OTAS_PROFILE = BENCH / "otas_cost_vit-demo.json"
OTAS_MODEL = "vit-demo"
TEXT_POLICIES = ("default", "arlo", "st", "dt", "infaas")
POLICIES = (*TEXT_POLICIES, "otas")
INSTANCES = (1, 100, 1000)
GOAL_PER_MIN = 1_000_000
QUEUE_PER_INSTANCE = 256  # the serve default (--max-queue 256) per instance


@dataclass(frozen=True)
class Setup:
    """One policy's model, cost model and workload, before the instance count is chosen."""

    name: str
    model: str
    cost: CostModel
    profile: str  # for the table
    slo_ms: float | None  # text: the stream's SLO; OTAS: per query type (in the trace)


def text_setup(name: str) -> Setup:
    cost = load_cost_model(TEXT_PROFILE)
    grid = simulated_models(cost, TEXT_MODEL)[TEXT_MODEL].grid
    slo = baselines.paper_scaled_slo(cost.latency[TEXT_MODEL], grid.max_length)
    return Setup(name, TEXT_MODEL, cost, f"{TEXT_MODEL} (serve)", slo * 1e3)


def otas_setup() -> Setup:
    from bench.otas_utility import paper_scaled

    cost, _, factor = paper_scaled(load_cost_model(OTAS_PROFILE))
    return Setup("otas", OTAS_MODEL, cost, f"{OTAS_MODEL} (OTAS, x{factor:.2f})", None)


def build(setup: Setup, instances: int):
    """The policy as ``jaxserve simulate --policy NAME --instances N`` builds it; OTAS's told its
    run began its initial stage before the trace (module docstring: OTAS in steady state)."""
    settings = ServeSettings(policy=setup.name, instances=instances, max_queue=QUEUE_PER_INSTANCE * instances,
                             slo_ms=setup.slo_ms)
    policy = make_policy(settings, simulated_models(setup.cost, setup.model), setup.cost)
    if setup.name == "otas":
        policy.start_time = -policy.params.initial_stage  # the trace's first arrival comes after 0
    return policy


def capacity_per_instance(setup: Setup, policy, lengths: np.ndarray) -> float:
    """Requests per second one instance serves under ``policy`` (module docstring: Load)."""
    profile = setup.cost.latency[setup.model]
    grid = simulated_models(setup.cost, setup.model)[setup.model].grid
    if setup.name == "otas":
        return grid.max_batch / profile.latency(Cell(grid.max_batch, 0, 0))
    values, counts = np.unique(lengths, return_counts=True)
    if setup.name != "default":  # runtime groups serve every bucket; else those the first allocation deploys
        deployed = policy.buckets if policy.shared else \
            tuple(b for b, k in policy.instances_per_runtime().items() if k > 0)
    per_request = []
    for length in values.tolist():
        if setup.name == "default":
            b, seconds = grid.max_batch, profile.latency(Cell(grid.max_batch, bucket_for_length(length, grid.seq_buckets)))
        else:  # the Arlo family: the deployed runtime (bucket) the request fits, at that runtime's max batch
            seq = bucket_for_length(length, deployed)
            b = policy.level_max_batch[policy.buckets.index(seq)]
            seconds = policy.service_seconds(b, length) if isinstance(policy, baselines.DynamicShapePolicy) \
                else profile.latency(Cell(b, seq))
        per_request.append(seconds / b)
    return 1.0 / float(np.average(per_request, weights=counts))


def make_workload(setup: Setup, rate: float, n: int, seed: int, lengths: np.ndarray | None) -> traces.Trace:
    arrivals = traces.poisson_arrivals(rate, n=n, seed=seed)
    if setup.name == "otas":
        from bench.otas_utility import QUERY_TYPES

        q = np.random.default_rng(seed + 1).integers(0, len(QUERY_TYPES), n)
        return traces.make_trace(arrivals, model=setup.model, task=[QUERY_TYPES[i][0] for i in q],
                                 slo_s=[QUERY_TYPES[i][1] for i in q], utility=[QUERY_TYPES[i][2] for i in q])
    return traces.make_trace(arrivals, model=setup.model, length=traces.sample_lengths(lengths, n, seed=seed + 1),
                             slo_s=setup.slo_ms / 1e3)


def timed(setup: Setup, instances: int, trace: traces.Trace, full_dp: bool = False):
    """(result, wall seconds of ``simulate``, the policy); ``full_dp``: OTAS runs Alg. 2's whole DP at
    every plan (``OTASParams.all_best_shortcut=False``)."""
    policy = build(setup, instances)
    if full_dp:
        policy.params = dataclasses.replace(policy.params, all_best_shortcut=False)
    t0 = time.perf_counter()
    result = simulate(policy, trace, setup.cost, instances)
    return result, time.perf_counter() - t0, policy


def run_cell(setup: Setup, instances: int, args, lengths: np.ndarray | None, load: float,
             full_dp: bool = True) -> dict:
    """One (policy, instances) cell at ``load`` of the policy's capacity; ``full_dp``: the OTAS
    cells' whole-DP arms too (as ``args`` asks)."""
    probe = build(setup, instances)
    rate = load * instances * capacity_per_instance(setup, probe, lengths if lengths is not None else np.zeros(1))
    pilot = make_workload(setup, rate, args.pilot, args.seed, lengths)
    _, wall, _ = timed(setup, instances, pilot)
    n = int(min(args.max_requests, max(args.pilot, args.pilot / wall * args.seconds)))
    trace = make_workload(setup, rate, n, args.seed, lengths) if n != args.pilot else pilot
    walls, result, policy = [], None, None
    for k in range(args.repeats):
        result, wall, policy = timed(setup, instances, trace)
        walls.append(wall)
        if wall > 3 * args.seconds:  # one long run is measurement enough
            break
    wall = statistics.median(walls)
    s = result.summary()
    out = dict(policy=setup.name, profile=setup.profile, instances=instances, load=load, rate=rate,
               requests=len(trace),
               virtual=result.span(), walls=walls, wall=wall, per_min=len(trace) / wall * 60,
               utilization=s["utilization"], batch=s["mean_batch_size"], slo=float(np.mean(result.outcome == OK)))
    if setup.name == "otas":
        out["shortcut"] = (policy.counters["dp_all_best"], policy.counters["dp_runs"])
        if args.full_dp and full_dp:
            out["full_dp"] = [full_dp_arm(setup, instances, trace, result, native=True)]
            if args.numpy_dp:
                out["full_dp"].append(full_dp_arm(setup, instances, trace, result, native=False))
    return out


RESULT_ARRAYS = ("start", "finish", "outcome", "batch", "cell_batch", "cell_seq", "cell_gamma", "batch_start",
                 "batch_finish", "batch_count", "batch_instance")


def full_dp_arm(setup: Setup, instances: int, trace: traces.Trace, reference, native: bool) -> tuple[float, bool]:
    """The same OTAS trace once more with Alg. 2's whole DP at every plan (no all-best shortcut), in
    native code or, ``native=False``, in Python/numpy (``JAXSERVE_NATIVE_DP=0``): (wall seconds,
    whether every array of the result equals ``reference``'s, the run with the shortcut)."""
    import os

    before = os.environ.get("JAXSERVE_NATIVE_DP")
    if not native:
        os.environ["JAXSERVE_NATIVE_DP"] = "0"
    try:
        plain, wall, _ = timed(setup, instances, trace, full_dp=True)
    finally:
        if before is None:
            os.environ.pop("JAXSERVE_NATIVE_DP", None)
        else:
            os.environ["JAXSERVE_NATIVE_DP"] = before
    same = all(np.array_equal(getattr(reference, f), getattr(plain, f), equal_nan=True) for f in RESULT_ARRAYS)
    return wall, same


HEADER = ["policy", "profile", "instances", "load", "rate req/s", "requests", "virtual s", "runs", "wall s (median)",
          "simulated req/min", "goal met", "utilization", "mean batch", "SLO att.",
          "Alg. 2 plans the all-best shortcut answered",
          "full DP at every plan, native; in numpy: wall s (one run), its / the median above, same result"]


def row(r: dict) -> list[str]:
    return [r["policy"], r["profile"], str(r["instances"]), f"{r['load']:.2f}", f"{r['rate']:,.0f}",
            f"{r['requests']:,}",
            f"{r['virtual']:,.1f}", str(len(r["walls"])), f"{r['wall']:.2f}", f"{r['per_min']:,.0f}",
            "yes" if r["per_min"] >= GOAL_PER_MIN else "**no**", f"{r['utilization']:.2f}", f"{r['batch']:.1f}",
            f"{r['slo']:.3f}", shortcut_cell(r), full_dp_cell(r)]


def shortcut_cell(r: dict) -> str:
    if "shortcut" not in r:
        return "-"
    answered, plans = r["shortcut"]
    return f"{answered:,} of {plans:,}"


def full_dp_cell(r: dict) -> str:
    if not r.get("full_dp"):
        return "-"
    return "; ".join(f"{wall:.2f}, {wall / r['wall']:.2f}x, {'identical' if same else '**differs**'}"
                     for wall, same in r["full_dp"])


def main() -> None:
    from bench.common import add_quick, apply_quick, table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of " + ", ".join(POLICIES))
    parser.add_argument("--instances", default=",".join(map(str, INSTANCES)))
    parser.add_argument("--load", type=float, default=0.7, help="offered load, a fraction of the policy's capacity")
    parser.add_argument("--overload", type=float, default=1.3,
                        help="every cell again at this load, without the full-DP arms (0: not)")
    parser.add_argument("--seconds", type=float, default=5.0, help="target wall time of one run of a cell")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (the median is reported)")
    parser.add_argument("--pilot", type=int, default=5000, help="requests of the run that sizes a cell")
    parser.add_argument("--max-requests", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-full-dp", dest="full_dp", action="store_false",
                        help="skip the OTAS cells' other arms (the same trace with the whole DP at every plan)")
    parser.add_argument("--no-numpy-dp", dest="numpy_dp", action="store_false",
                        help="skip the OTAS cells' arm with the whole DP in Python/numpy")
    parser.add_argument("--write", action="store_true", help="record the table in bench/RESULTS.md")
    add_quick(parser, seconds=0.05, repeats=1, pilot=500, max_requests=1000)
    args = apply_quick(parser.parse_args())
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    counts = [int(x) for x in args.instances.split(",") if x]

    lengths = None
    if set(policies) & set(TEXT_POLICIES):
        from jaxserve.datasets import tweet_token_lengths

        grid = simulated_models(load_cost_model(TEXT_PROFILE), TEXT_MODEL)[TEXT_MODEL].grid
        lengths = np.minimum(tweet_token_lengths(), grid.max_length)
    setups = {p: otas_setup() if p == "otas" else text_setup(p) for p in policies}
    print(f"offered load {args.load:.2f}" + (f", then {args.overload:.2f}," if args.overload > 0 else "")
          + f" of each policy's capacity; one run ~{args.seconds:g} s, "
          f"median of up to {args.repeats}\n")
    print("| " + " | ".join(HEADER) + " |", flush=True)
    rows = []
    t_all = time.perf_counter()
    loads = [(args.load, True)] + ([(args.overload, False)] if args.overload > 0 else [])
    for load, full in loads:
        for p in policies:
            for n in counts:
                r = run_cell(setups[p], n, args, lengths, load, full)
                rows.append(r)
                print("| " + " | ".join(row(r)) + " |", flush=True)
    elapsed = time.perf_counter() - t_all
    text = table(HEADER, [row(r) for r in rows])
    missed = [f"{r['policy']} at {r['instances']} (load {r['load']:.2f})" for r in rows if r["per_min"] < GOAL_PER_MIN]
    notes = (
        f"Goal: ≥ {GOAL_PER_MIN:,} simulated requests per minute of wall time for every policy and instance count "
        f"({'met everywhere' if not missed else 'missed by ' + ', '.join(missed)}). Offered load {args.load:.2f} of "
        "each policy's own capacity (batch size and executable as it runs each request: see the script's docstring)"
        + (f", and every cell again at {args.overload:.2f} (overload: queues fill, requests are evicted, and OTAS's "
           "Alg. 2 must trade batches off; without the full-DP arms)" if args.overload > 0 else "") + ", "
        "Poisson arrivals. Text policies: the MiniLM-L6 serve profile, real tweet lengths, the paper-scaled Arlo SLO "
        f"({text_setup('default').slo_ms:.0f} ms), max_wait 0, max_queue 256 per instance. OTAS: the demo ViT's "
        "profile scaled to 580 req/s at gamma 0, Table II's query types, in steady state: each OTAS policy is told "
        "its run began its 2 s initial stage (Alg. 3 only) before the trace, so it plans by Alg. 2 from the first "
        "plan (the script's docstring). Wall time of `simulate` only; 'virtual s' "
        "is the simulated span (Arlo's Runtime Scheduler runs every 120 s of it, after 10 s). The OTAS cells also run "
        "their trace once with Alg. 2's whole DP at every plan (`OTASParams(all_best_shortcut=False)`), in native "
        "code and in Python/numpy (`JAXSERVE_NATIVE_DP=0`), and compare every array of each result with the run "
        "above: the shortcut's and the native DP's speed-ups, in the same run. "
        f"Whole run: {elapsed:.0f} s.")
    print()
    print(text)
    print()
    print(notes)
    if args.write:
        from bench.common import record

        record("sim_speed", "Simulator speed per policy", text, notes)


if __name__ == "__main__":
    main()
