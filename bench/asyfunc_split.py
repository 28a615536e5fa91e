"""AsyFunc's body/shadow split, live (jaxserve/asyfunc_exec.py): how soon a shadow is ready, and
whether Eq. 3's latency model holds for one split.

Real all-MiniLM-L6-v2 weights; one local Ray; one compile cache filled in this process first
(no tuning), so every actor loads and nothing compiles at request time.

* **Time to ready**, on the driver's clock, from asking to holding the actor's report: a
  *body* (a fresh actor loading and priming the whole model, ``RayWorker``), a *shadow from the
  pool* (the node's warm actor, already started with the candidate block's executables prepared,
  ``ShadowHost.prepare``, loading the block's parameters: ``PoolWorker.load``),
  first reading the whole model's checkpoint and slicing it, then (once the block has its own
  checkpoint in the cache, as a server's start writes it) reading only the block's; and a
  *shadow from a fresh actor* (process start plus the block from its checkpoint).
* **Split latency**: ``b`` rows on the body (this process) with rows ``[b_B:b)`` of the block on
  the pool shadow, against the body alone. The components are measured apart: ``t_np`` (the
  non-parallel part, pre + post at ``b``), ``t_pB`` (the block at ``b_B`` here), ``t_pS`` (the
  block at ``b_S`` on the shadow, its own clock) and the transfer (the shadow's round trip minus
  its compute), and put into ``t = max(t_np + t_pB, t_np + t_pS + transfer)``. Medians over
  rounds. On this 2-core machine the shadow's process and the body share the cores.

    python -m bench.asyfunc_split [--batch 8] [--body-rows 4] [--length 64] [--block 1:5] [--rounds 30]
                                  [--repeats 3] [--write] [--quick]
"""

from __future__ import annotations

MEASURES = (
    "bench/asyfunc_split.py", "jaxserve/asyfunc_exec.py", "jaxserve/stages.py", "jaxserve/ray_workers.py",
    "jaxserve/workers.py", "jaxserve/polymorph.py", "jaxserve/servables.py", "jaxserve/models",
    "jaxserve/keys_manager.py", "jaxserve/orbax_io.py",
)
SECTIONS = {"asyfunc_split": "--write"}

import argparse
import os
import statistics
import tempfile
import time

from bench.common import add_quick, apply_quick, record, table

MODEL = "minilm-l6"


def _spec(cache_dir: str, grid):
    from jaxserve.ray_workers import WorkerSpec

    env = {k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_", "JAXSERVE_"))}
    return WorkerSpec(models=(MODEL,), cache_dir=cache_dir, tune=False, text_grid=grid,
                      env=tuple(sorted(env.items())))


def _ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="b: rows of the non-parallel part")
    ap.add_argument("--body-rows", type=int, default=4, help="b_B: the block's rows on the body")
    ap.add_argument("--length", type=int, default=64, help="sequence bucket")
    ap.add_argument("--block", default="1:5", help="the shadowed layers i:j")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="actor starts per kind")
    ap.add_argument("--write", action="store_true")
    add_quick(ap, batch=4, body_rows=2, length=16, rounds=5, repeats=1)
    args = apply_quick(ap.parse_args())

    from jaxserve.ray_workers import ensure_ray

    ensure_ray(None, num_cpus=4)  # before JAX starts in this process
    import numpy as np
    import ray

    from jaxserve.asyfunc_exec import Body, PoolWorker, write_block_checkpoint
    from jaxserve.compile_cache import CompileCache, compile_count
    from jaxserve.ray_workers import RayWorker
    from jaxserve.registry import load_text_runtime
    from jaxserve.sched.base import ShapeGrid, Stage
    from jaxserve.workers import Step

    b, b_B = args.batch, args.body_rows
    b_S = b - b_B
    batches = tuple(sorted({1, 2, 4, b, b_B, b_S} - {0}))
    grid = ShapeGrid(batch_sizes=batches, seq_buckets=(args.length,))
    i, j = (int(x) for x in args.block.split(":"))
    try:
        with tempfile.TemporaryDirectory(prefix="asyfunc-split-cache-") as cache_dir:
            cache = CompileCache(cache_dir)
            rt = load_text_runtime(MODEL, cache, grid, tune=False)
            block = Stage(MODEL, i, j, rt.num_layers)
            body = Body(rt, block, cache)
            spec = _spec(cache_dir, grid)
            whole = Stage(MODEL, 0, rt.num_layers, rt.num_layers)

            # ---------------------------------------------------------------- time to ready
            body_key = "body (fresh actor, whole model)"
            ready = {body_key: []}

            def pool_shadow(key: str, wid: int) -> None:
                pool = PoolWorker(wid, spec, [])
                pool.ready.result(timeout=600)
                ray.get(pool.actor.prepare.remote([block]))  # the pool's warm executables, as a server's
                t0 = time.perf_counter()
                pool.load(block).result(timeout=600)
                ready.setdefault(key, []).append(time.perf_counter() - t0)
                pool.close()

            for r in range(args.repeats):  # before the block has a checkpoint of its own
                w = RayWorker(100 + r, spec, [whole])
                ready[body_key].append(w.ready.result(timeout=600))
                w.close()
                pool_shadow("shadow from the pool, reading the whole model", 200 + r)
            write_block_checkpoint(body.runners[block], cache.root)  # as a server's start does
            for r in range(args.repeats):
                pool_shadow("shadow from the pool, reading its block checkpoint", 300 + r)
                fresh = PoolWorker(400 + r, spec, [block])
                ready.setdefault("shadow from a fresh actor, reading its block checkpoint", []).append(
                    fresh.ready.result(timeout=600))
                fresh.close()
            body_s = statistics.median(ready[body_key])
            ready_rows = [[k, f"{statistics.median(v):.2f}", f"{min(v):.2f}",
                           f"{statistics.median(v) / body_s:.2f}", str(len(v))] for k, v in ready.items()]

            # ---------------------------------------------------------------- one split
            shadow = PoolWorker(500, spec, [block])
            shadow.ready.result(timeout=600)
            texts = [f"sentence number {k} says something {'rather ' * (k % 5)}different" for k in range(b)]
            payloads = [x[: args.length] for x in rt.tokenizer.encode(texts)]
            tasks = [""] * b
            cell = body.cell_for(payloads)
            compiles = compile_count()
            pre_carry = None if body.pre is None else body.runners[body.pre].execute(cell, payloads, tasks).carry
            host_carry = None if pre_carry is None else pre_carry.rows(range(b))
            s_cell = grid.cell_for(b_S, cell.seq)
            s_part = None if host_carry is None else host_carry.rows(range(b_B, b))
            s_payloads = tuple(payloads[b_B:]) if block.first else ()
            meas = {k: [] for k in ("alone", "split", "t_np", "t_pB", "t_pS", "transfer", "split_t_pS",
                                    "split_transfer")}
            want, _ = body.run(payloads, tasks)
            for _ in range(2):  # first calls
                body.run(payloads, tasks, b_B, shadow)
            for _ in range(args.rounds):
                _, t_alone = body.run(payloads, tasks)
                meas["alone"].append(t_alone.total)
                meas["t_np"].append(t_alone.t_np)
                t0 = time.perf_counter()
                body._run_block_here(cell, payloads, tasks, pre_carry, 0, b_B)
                meas["t_pB"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                step_out = shadow.submit(Step(block, s_cell, s_payloads, tuple(tasks[b_B:]), s_part)).result()
                wall = time.perf_counter() - t0
                meas["t_pS"].append(step_out.compute_seconds)
                meas["transfer"].append(wall - step_out.compute_seconds)
                got, t_split = body.run(payloads, tasks, b_B, shadow)
                assert not t_split.recomputed
                meas["split"].append(t_split.total)
                meas["split_t_pS"].append(t_split.t_pS)
                meas["split_transfer"].append(t_split.transfer)
                meas.setdefault("split_modelled", []).append(t_split.modelled())
            worst = max(float(np.max(np.abs(g["embedding"] - w["embedding"]))) for g, w in zip(got, want))
            assert shadow.compilations() == 0 and compile_count() == compiles, "a compile at request time"
            shadow.close()
    finally:
        ray.shutdown()

    med = {k: statistics.median(v) for k, v in meas.items()}
    modelled = max(med["t_np"] + med["t_pB"], med["t_np"] + med["t_pS"] + med["transfer"])
    split_rows = [
        ["t_np (pre + post at b, body)", _ms(med["t_np"])],
        ["t_pB (block at b_B, body)", _ms(med["t_pB"])],
        ["t_pS (block at b_S, shadow's compute)", _ms(med["t_pS"])],
        ["transfer (shadow round trip - compute)", _ms(med["transfer"])],
        ["modelled t = max(t_np + t_pB, t_np + t_pS + transfer)", _ms(modelled)],
        ["measured split (body + pool shadow)", _ms(med["split"])],
        ["measured body alone (b rows)", _ms(med["alone"])],
        ["in the split: t_pS / transfer", f"{_ms(med['split_t_pS'])} / {_ms(med['split_transfer'])}"],
        ["modelled from the split's own parts (SplitTimes.modelled)", _ms(med["split_modelled"])],
    ]
    head = (f"{MODEL}, block {block.label()}, b={b} (b_B={b_B}, b_S={b_S}), bucket {args.length}; "
            f"{args.rounds} rounds, medians; split vs unsplit max |diff| {worst:.2e}")
    body_md = ("Time to ready (s, driver's clock):\n\n"
               + table(["what", "median s", "min s", "median / body's", "n"], ready_rows)
               + "\n\n" + head + "\n\n" + table(["latency part", "ms"], split_rows))
    notes = reading({k: statistics.median(v) for k, v in ready.items()}, med, modelled, worst)
    print(body_md)
    print(notes)
    if args.write:
        record("asyfunc_split", "AsyFunc body/shadow split: time to ready and Eq. 3 on one split", body_md, notes)


def reading(ready: dict[str, float], med: dict[str, float], modelled: float, worst: float) -> str:
    """The section's reading, from this run's figures."""
    body = ready["body (fresh actor, whole model)"]
    block = ready["shadow from the pool, reading its block checkpoint"]
    whole = ready["shadow from the pool, reading the whole model"]
    fresh = ready["shadow from a fresh actor, reading its block checkpoint"]
    goal = "meets" if block <= 0.10 * body else "misses"
    faster = "faster" if med["split"] < med["alone"] else "slower"
    return (f"**Reading.** A shadow made from the warm pool actor (its candidate block's executables prepared "
            f"when the pool started) is ready {block:.2f} s after it is asked for when it reads its block's own "
            f"checkpoint, against {body:.2f} s for a fresh body actor loading the whole model: {block / body:.2f}x, "
            f"which {goal} the issue's goal of <= 0.10x. Reading the whole model's checkpoint and slicing it "
            f"instead takes {whole:.2f} s ({whole / body:.2f}x); a shadow in a fresh actor {fresh:.2f} s, process "
            f"start and imports dominating. The split's answers equal the unsplit model's (max |diff| "
            f"{worst:.1e}). On these 2 shared cores the split is {faster} than the body alone "
            f"({1e3 * med['split']:.1f} vs {1e3 * med['alone']:.1f} ms): the shadow's share of the block takes "
            f"{1e3 * med['split_t_pS']:.1f} ms inside the split against {1e3 * med['t_pS']:.1f} ms on its own, "
            f"since the two halves compete for the same cores. Eq. 3 with the parts measured alone predicts "
            f"{1e3 * modelled:.1f} ms ({modelled / med['split']:.2f} of the measured split); with the parts measured "
            f"inside the split {1e3 * med['split_modelled']:.1f} ms ({med['split_modelled'] / med['split']:.2f}). "
            f"The split pays only where the shadow has cores of its own.")


if __name__ == "__main__":
    main()
