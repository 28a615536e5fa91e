"""Clients that give up: what withdrawing their queued items buys under overload.

Real clients have timeouts. When a server is overloaded, a client that waited too long
closes its connection (and often retries). A server that keeps its items queued then
spends its capacity on answers nobody reads, while the clients still waiting queue
behind that dead work: past the point where the queue's wait exceeds the clients'
patience, almost nothing is answered in time. jaxserve withdraws a request's queued
items when its client disconnects (``Engine.withdraw``; they never run).

Two arms, one run, the same trace (real tweets, Poisson arrivals above capacity) against
``jaxserve serve --model minilm-l6`` with its defaults:

* ``withdraw``: the server as shipped;
* ``keep``: the same server with ``Engine.withdraw`` replaced by a no-op in its process
  (an ablation: abandoned items stay queued and run, as in a server without the feature).

A third and fourth arm tell the server the clients' patience: each client sends it as
``slo_ms``, or the server gets it as its default deadline (``--slo-ms``) and the clients
send nothing, as OpenAI's client does unless told to (its API has no such field).

Every client gives up after ``--timeout`` seconds and closes its connection. Reported per
arm: answers received in time per second (goodput), their latency, how many clients gave
up, how many were refused with 429, and from the server's ``/metrics`` once it is idle
again: items computed, items withdrawn, and items computed for clients that had left.

Then the same arms in the simulator, calibrated on the first arm's answers only, to check
that it predicts overload with impatient clients (``simulate(client_timeout=)``), not just
the moderate load ``bench/fidelity.py`` checks.
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/abandon.py", "bench/load.py", "bench/httpload.py", "bench/fidelity.py", "jaxserve/simulator.py",
    "serving", "jaxserve/engine.py", "jaxserve/launch.py", "jaxserve/workers.py", "jaxserve/cli.py",
    "jaxserve/sched/base.py", "jaxserve/sched/batching.py", "jaxserve/models", "jaxserve/kernels",
    "jaxserve/polymorph.py", "jaxserve/servables.py", "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {"abandon": "--write"}

import argparse
import asyncio
import sys
import time

import numpy as np
import orjson

from bench.common import add_quick, apply_quick, record, scrape, table
from bench.httpload import Pool, at
from bench.load import TEXT_PATH, arrivals, sample_texts, start, stop

ABLATION = ("import sys, jaxserve.engine as e; e.Engine.withdraw = lambda self, futures: 0; "
            "from jaxserve.cli import main; sys.exit(main(sys.argv[1:]))")


async def impatient(url: str, schedule: np.ndarray, texts: list[str], timeout_s: float, send_slo: bool) -> dict:
    """Open loop; each client closes its connection after ``timeout_s`` without an answer
    (and with ``send_slo`` tells the server so, as ``slo_ms``)."""
    pool = Pool(url, timeout=timeout_s)
    counts = {"answered": 0, "evicted": 0, "gave_up": 0, "429": 0, "other": 0}
    extra = {"slo_ms": timeout_s * 1e3} if send_slo else {}
    latencies: list[float] = []
    computed: list[tuple[str, float, float]] = []  # (shape, compute ms, held ms) of answers: calibration
    start_t = time.perf_counter()

    async def one(i: int, when: float):
        await at(start_t, when)
        try:
            r = await pool.post(TEXT_PATH, orjson.dumps({"input": texts[i % len(texts)], **extra}))
        except asyncio.TimeoutError:
            counts["gave_up"] += 1
            return
        except (OSError, asyncio.IncompleteReadError):
            counts["other"] += 1
            return
        meta = orjson.loads(r.body)["data"][0]["meta"] if r.status == 200 else None
        if meta is not None and meta["outcome"] == "evicted":
            counts["evicted"] += 1  # answered at once: the server saw it could not make slo_ms
        elif meta is not None:
            counts["answered"] += 1
            latencies.append(time.perf_counter() - start_t - when)
            computed.append((meta["shape"], meta["compute_ms"], meta["latency_ms"] - meta["queue_ms"]))
        elif r.status == 429:
            counts["429"] += 1
        else:
            counts["other"] += 1

    try:
        await asyncio.gather(*(one(i, float(t)) for i, t in enumerate(schedule)))
    finally:
        await pool.close()
    return {**counts, "latencies": np.array(latencies), "computed": computed}


def simulated_goodput(args, schedule, lengths, cal_computed) -> tuple[dict[str, float], int]:
    """The arms in the simulator: the server's policy, cost model and 2 instances, clients
    leaving after ``args.timeout`` (``simulate(client_timeout=)``), batches priced from the
    profile with the (slow-down, hand-off) pairs measured on the *withdraw* arm's answers
    (``bench.fidelity.calibrate``): fitted on one arm, it predicts the other three. Returns
    answers in time per second by arm, and how many batches the calibration had."""
    from bench.fidelity import calibrate, empirical_service, grid_of
    from jaxserve import traces
    from jaxserve.profiler import load_cost_model
    from jaxserve.sched.batching import DeadlineBatching
    from jaxserve.simulator import simulate

    cost = load_cost_model(f"{args.cache_dir}/cost_model.json")
    grid = grid_of(cost, "minilm-l6")
    cal = calibrate(cost, cal_computed)
    out = {}
    for name, withdraw, slo in (("withdraw", True, False), ("keep", False, False), ("slo", True, True)):
        policy = DeadlineBatching({"minilm-l6": grid}, cost, max_queue=256, max_wait=0.0)
        trace = traces.make_trace(schedule, model="minilm-l6", length=lengths,
                                  slo_s=args.timeout if slo else float("inf"))
        res = simulate(policy, trace, cost, instances=2, service_time=empirical_service(cost, cal, args.seed + 7),
                       client_timeout=args.timeout, withdraw_when_clients_leave=withdraw)
        out[name] = res.outcome_counts()["ok"] / args.duration
    return out, len(cal)


def server_items(url: str, settle_s: float = 120.0) -> dict[str, float]:
    """``jaxserve_items`` by outcome once nothing is queued or running any more."""
    deadline = time.monotonic() + settle_s
    while True:
        series = scrape(url, "jaxserve_items{", "jaxserve_in_flight ")
        if series.get("jaxserve_in_flight", 0) == 0 or time.monotonic() > deadline:
            return {name.split('"')[1]: v for name, v in series.items() if name.startswith("jaxserve_items{")}
        time.sleep(0.5)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=float, default=360.0, help="offered requests/s (capacity here: ~180/s)")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=1.0, help="seconds each client waits before it leaves")
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument("--cache-dir", default="compiled_cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true")
    add_quick(ap, duration=2.0, rate=50.0)
    args = apply_quick(ap.parse_args())
    texts = sample_texts()
    schedule = arrivals("poisson", args.rate, args.duration, args.seed)
    url = f"http://127.0.0.1:{args.port}"
    serve = ["serve", "--model", "minilm-l6", "--port", str(args.port), "--cache-dir", args.cache_dir]
    shipped = [sys.executable, "-m", "jaxserve.cli", *serve]
    server_slo = [*shipped, "--slo-ms", f"{args.timeout * 1e3:g}"]
    arms = {"withdraw": (shipped, False), "keep": ([sys.executable, "-c", ABLATION, *serve], False),
            "withdraw, clients send slo_ms": (shipped, True),
            f"withdraw, server --slo-ms {args.timeout * 1e3:g}": (server_slo, False)}
    rows, goodput, answered_batches = [], {}, {}
    for name, (cmd, send_slo) in arms.items():
        print(f"{name}: starting the server", flush=True)
        server = start(cmd, url)
        try:
            print(f"{name}: {len(schedule)} requests at {args.rate:.0f}/s, clients leave after {args.timeout} s",
                  flush=True)
            res = asyncio.run(impatient(url, schedule, texts, args.timeout, send_slo))
            answered_batches[name] = res["computed"]
            items = server_items(url)
        finally:
            stop(server)
        computed = items.get("ok", 0) + items.get("late", 0)
        nobody = computed - res["answered"]
        goodput[name] = res["answered"] / args.duration
        lat = res["latencies"]
        p = (lambda q: f"{np.percentile(lat, q) * 1e3:.0f}") if len(lat) else (lambda q: "-")
        rows.append([name, str(len(schedule)), f"{goodput[name]:.1f}", p(50), p(98), str(res["gave_up"]),
                     str(res["429"]), str(res["evicted"]), str(res["other"]), f"{computed:.0f}",
                     f"{items.get('withdrawn', 0):.0f}", f"{nobody:.0f}"])
        print(f"  {rows[-1]}", flush=True)
    body = table(["server", "sent", "answered in time /s", "p50 ms", "p98 ms", "clients gave up", "429",
                  "evicted", "other", "items computed", "withdrawn", "computed for nobody"], rows)
    from jaxserve.models.tokenizer import TextTokenizer
    from jaxserve.registry import minilm_dir

    ids = TextTokenizer(minilm_dir() / "tokenizer.json").encode(texts)
    lengths = [len(ids[i % len(texts)]) for i in range(len(schedule))]
    sim, n_batches = simulated_goodput(args, schedule, lengths, answered_batches["withdraw"])
    sim_of = dict(zip(arms, ("withdraw", "keep", "slo", "slo")))
    sim_rows = [[name, f"{goodput[name]:.1f}", f"{sim[sim_of[name]]:.1f}",
                 f"{(sim[sim_of[name]] - goodput[name]) / goodput[name] * 100:+.0f}%"] for name in arms]
    body += "\n\nThe same arms in the simulator (`jaxserve.simulator`, clients leaving as live ones do):\n\n" + table(
        ["server", "live answered in time /s", "simulated", "sim vs live"], sim_rows)
    keep = goodput["keep"] or float("nan")
    notes = (f"Offered {args.rate:.0f} requests/s (one text each) for {args.duration:.0f} s, Poisson, real "
             f"tweets; every client leaves after {args.timeout} s. Answers in time, ratio to keep: withdraw "
             f"**{goodput['withdraw'] / keep:.1f}x**, withdraw with slo_ms "
             f"**{goodput['withdraw, clients send slo_ms'] / keep:.1f}x**, withdraw with the server's default "
             f"deadline (clients send nothing) **{goodput[list(arms)[3]] / keep:.1f}x**. "
             f"\"computed for nobody\": items the "
             f"server ran whose client had already left (items computed minus answers received). Withdrawal "
             f"only reaches items still queued: under overload a FIFO queue's wait approaches the clients' "
             f"patience, so many items start just before their client leaves and finish after. A client that "
             f"sends its timeout as slo_ms lets the policy evict (answered at once, `evicted`) what can no "
             f"longer finish in time instead; a client that does not (OpenAI's API has no such field) gets the "
             f"same from the server's `--slo-ms`, the deadline of every request that carries none.  \n"
             f"Simulated: the server's policy (default, max_wait 0, max_queue 256), cost model and 2 instances "
             f"on the same arrivals and token lengths, each client leaving after {args.timeout} s "
             f"(`simulate(client_timeout=)`: still queued -> `Policy.withdraw`, finished later -> abandoned); "
             f"each batch priced profile x a (slow-down, hand-off) pair drawn from the withdraw arm's "
             f"{n_batches} batches (of its batch size) behind its answers (`bench.fidelity.calibrate`). "
             f"Fitted on the withdraw arm, it predicts the other three; both slo arms are one trace with "
             f"deadline = patience to the simulator. Simulated ratio to keep: withdraw "
             f"{sim['withdraw'] / sim['keep']:.1f}x, slo {sim['slo'] / sim['keep']:.1f}x.")
    print(body + "\n\n" + notes)
    if args.write:
        record("abandon", "Clients that give up: withdrawing their queued items (bench/abandon.py)", body, notes)


if __name__ == "__main__":
    main()
