"""The command line as a user runs it."""

import json
import subprocess
import sys

from jaxserve.sched.base import Cell, CostModel, LatencyProfile


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_warmup_writes_manifest_then_loads_serialized(tmp_path):
    cache = tmp_path / "cache"
    first = run("warmup", "--model", "vit-demo", "--cache-dir", str(cache))
    assert first.returncode == 0, first.stderr
    assert "6 executables (6 compiled)" in first.stdout
    manifest = json.loads((cache / "manifest.json").read_text())
    assert {e["model"] for e in manifest["entries"]} == {"vit-demo"}
    (cache / "executables" / "stale.json").write_text(json.dumps({"model": "vit-demo"}))  # an older version's
    (cache / "executables" / "stale.bin").write_bytes(b"old")
    second = run("warmup", "--model", "vit-demo", "--cache-dir", str(cache), "--prune")
    assert "6 executables (6 serialized)" in second.stdout
    assert "pruned 1 stale entries of vit-demo" in second.stdout
    assert not (cache / "executables" / "stale.bin").exists()
    assert len(list((cache / "executables").glob("*.bin"))) == 6


def test_simulate_replays_a_trace_file(tmp_path):
    cells = {Cell(b, s): 0.001 * b + 0.00005 * s * b for b in (1, 4) for s in (16, 64)}
    cost = CostModel({"minilm-l6": LatencyProfile("minilm-l6", cells)})
    (tmp_path / "cost.json").write_text(cost.to_json())
    trace = tmp_path / "trace.csv"
    rows = ["arrival,length,slo_ms,utility"] + [f"{i * 0.01:.2f},{10 + i % 50},100,1" for i in range(300)]
    trace.write_text("\n".join(rows) + "\n")
    out = run("simulate", "--cost-model", str(tmp_path / "cost.json"), "--trace", str(trace))
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["requests"] == 300
    assert summary["ok"] + summary["late"] + summary["evicted"] + summary["rejected"] == 300
    assert summary["slo_attainment"] > 0.9
    # the live hand-off, modelled: every batch holds its instance 2 ms longer
    held = json.loads(run("simulate", "--cost-model", str(tmp_path / "cost.json"), "--trace", str(trace),
                          "--batch-overhead-ms", "2", "--latency-noise", "0.1").stdout)
    assert held["mean_latency"] > summary["mean_latency"] + 0.002
