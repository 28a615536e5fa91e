"""Regenerate every CPU section of bench/RESULTS.md on this machine, in one run (``make bench``).

    python -m bench.all [--quick] [--dry-run] [--only KEYS] [--skip KEYS] [--out DIR] [--timeout S]

Runs, in :data:`ORDER` (a script that ``PRODUCES`` a file before every script that measures it:
fidelity's calibrations, sim_knee's cost model, the OTAS cost models, the Ray hop), every section each script declares in
its ``SECTIONS`` (bench/common.py), as ``python -m bench.<script> <arguments>``, each stamped by
bench.common.stamp. Sections a script declares in ``GPU_SECTIONS`` are never run here: they come
from a GPU host and keep their stamp. A section's hand-written reading survives its rerun, marked
for review (bench.common.carried_reading), and ``python -m bench.status`` lists what to review.

``--quick`` is the smoke version: each script's ``--quick`` (the same code path on tiny sizes),
with every output redirected to ``--out`` (default ``$TMPDIR/jaxserve-bench-quick``): quick
numbers never replace real ones (bench.common also refuses a quick section for
bench/RESULTS.md). A failing run is reported and the next one starts; the exit status is 1 if
any failed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, declared_scripts

# Scripts whose order matters, in the order they run; a script that declares sections and is
# missing here runs after these, by name. A script that PRODUCES a file runs before every script
# whose MEASURES name it (tests/unit/test_bench_harness.py checks): fidelity's calibrations and
# its servers' cost model before sim_knee and fidelity_sensitivity; sim_knee's copy of that cost
# model before sim_speed and arlo_short; otas_profile's before the OTAS runs; workers' Ray hop
# before QUART's.
ORDER = (
    "arlo_solver", "arlo_sim",
    "polymorph", "tuning", "coldstart", "stages", "workers", "peer",
    "otas_profile", "otas_throughput", "otas_accuracy", "otas_utility", "otas_live",
    "tabi_sim", "load", "fidelity", "sim_knee", "sim_speed", "arlo_short", "abandon", "arlo_live", "tabi_live",
)


def plan(quick: bool = False, only: set[str] | None = None, skip: set[str] = frozenset()) -> list[tuple[str, str, list[str]]]:
    """``[(script, section key, argv)]`` to run: every declared CPU section, in :data:`ORDER`.
    ``only``/``skip`` name section keys or script names."""
    decl = declared_scripts()
    names = [n for n in ORDER if n in decl] + sorted(n for n in decl if n not in ORDER)
    out = []
    for name in names:
        for key, args in decl[name].get("SECTIONS", {}).items():
            if only and key not in only and name not in only:
                continue
            if key in skip or name in skip:
                continue
            argv = [sys.executable, "-m", f"bench.{name}", *shlex.split(args)]
            if quick:
                argv.append("--quick")
            out.append((name, key, argv))
    return out


def run_one(cmd: list[str], env: dict, timeout: float | None) -> int | str:
    """Run one script; its exit status, or "timeout". A script past ``timeout`` gets SIGINT first,
    so its ``finally`` blocks stop the servers it started (they run in their own sessions, out of
    reach of a kill of its process group), then SIGTERM, then SIGKILL."""
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, MARKER: marker})
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGINT, 60), (signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            proc.send_signal(sig)
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return "timeout"
    except KeyboardInterrupt:  # Ctrl-C reached the script too; let it clean up, then stop here
        proc.wait()
        raise
    finally:
        _stop_leftovers(marker)


MARKER = "JAXSERVE_BENCH_RUN"


def _stop_leftovers(marker: str) -> list[int]:
    """SIGTERM, then SIGKILL, every process still alive that this run started (found by the
    ``JAXSERVE_BENCH_RUN`` marker its environment inherited: servers a killed script left in
    their own sessions); their pids."""
    pids = []
    needle = f"{MARKER}={marker}".encode()
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (d / "environ").read_bytes().split(b"\0") and int(d.name) != os.getpid():
                pids.append(int(d.name))
        except (OSError, ValueError):
            continue
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            break
        time.sleep(5)
    if pids:
        print(f"bench.all: stopped {len(pids)} process(es) the run left behind: {pids}", flush=True)
    return pids


def _names(text: str | None) -> set[str]:
    return {x.strip() for x in (text or "").split(",") if x.strip()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: each script's --quick, into --out")
    ap.add_argument("--dry-run", action="store_true", help="list the commands, run nothing")
    ap.add_argument("--only", help="comma-separated section keys or script names")
    ap.add_argument("--skip", help="comma-separated section keys or script names")
    ap.add_argument("--out", type=Path, default=None,
                    help="write RESULTS.md, plots and side outputs here (default: bench/ for a full run, "
                         "$TMPDIR/jaxserve-bench-quick for --quick)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (default: none)")
    args = ap.parse_args(argv)
    runs = plan(args.quick, _names(args.only) or None, _names(args.skip))
    out = args.out or (Path(tempfile.gettempdir()) / "jaxserve-bench-quick" if args.quick else None)
    env = dict(os.environ)
    env.pop("JAXSERVE_BENCH_OUT", None)
    if out is not None:
        env["JAXSERVE_BENCH_OUT"] = str(Path(out).resolve())
    where = f"{out}/RESULTS.md" if out is not None else "bench/RESULTS.md"
    print(f"bench.all: {len(runs)} sections{' (quick)' if args.quick else ''} -> {where}", flush=True)
    failed = []
    t_all = time.perf_counter()
    for i, (name, key, cmd) in enumerate(runs, 1):
        shown = "python " + " ".join(shlex.quote(a) for a in cmd[1:])
        print(f"[{i}/{len(runs)}] {key}: {shown}", flush=True)
        if args.dry_run:
            continue
        t0 = time.perf_counter()
        rc = run_one(cmd, env, args.timeout)
        dt = time.perf_counter() - t0
        print(f"[{i}/{len(runs)}] {key}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {dt:.0f} s "
              f"({time.perf_counter() - t_all:.0f} s so far)", flush=True)
        if rc != 0:
            failed.append(key)
    if not args.dry_run:
        print(f"bench.all: {len(runs) - len(failed)}/{len(runs)} sections written to {where}"
              + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
        if out is None:
            print("next: python -m bench.status; python -m bench.headline --write", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
