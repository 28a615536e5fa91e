"""Torch side of bench/peer.py. Runs under .venv-ref/bin/python, never imported by jaxserve.

A long-lived worker so the peer benchmark can interleave JAX and torch timings in the
same minutes of a shared machine: it reads one JSON command per line on stdin and
answers one JSON line on stdout (logs go to stderr).

Commands
  {"cmd": "load", "model": name, "dir": hf_dir}          -> {"ok": true}
  {"cmd": "setup", "impl": impl, "model": name, "ids": [[..]], "mask": [[..]], "autocast": ""}
        builds the callable for (impl, shape) and runs it once; answers the time to
        that first result (for torch.compile: the per-shape compile) and the
        embedding, for the parity check. autocast "bf16": the callable runs under
        torch.autocast("cpu", dtype=torch.bfloat16) (torch's own reduced-precision CPU mode,
        the peer of jaxserve's --precision bf16); the embedding comes back as float32.
  {"cmd": "time", "impl": impl, "model": name, "batch": b, "seq": s, "reps": n}
        -> {"seconds": [...], "cpu_seconds": [...]} for n calls on the inputs given at setup
        (cpu_seconds: this process's CPU time per call, all threads)
  {"cmd": "matmul", "n": 2048, "reps": r}    -> {"gflops": [...], "gflops_per_cpu_second": [...]}
  {"cmd": "quit"}

impl is one of "eager-sdpa", "eager-eager", "compile-default", "compile-max-autotune"
(max-autotune-no-cudagraphs), optionally prefixed "f32:" (float32 whatever autocast says). Every impl computes what jaxserve's encode fn computes:
BertModel forward, mean pooling over real tokens, L2 normalisation, under
torch.inference_mode(), float32 unless autocast is asked for.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch


def log(*a):
    print("[torch-worker]", *a, file=sys.stderr, flush=True)


torch.set_num_threads(int(os.environ.get("PEER_TORCH_THREADS", "2")))
torch.set_grad_enabled(False)

from transformers import BertModel  # noqa: E402

MODELS: dict[tuple[str, str], torch.nn.Module] = {}  # (model, attn_impl) -> module
DIRS: dict[str, str] = {}
CALLABLES: dict[tuple[str, str, int, int], object] = {}  # (impl, model, b, s) -> fn
INPUTS: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def module(model: str, attn: str) -> torch.nn.Module:
    key = (model, attn)
    if key not in MODELS:
        m = BertModel.from_pretrained(DIRS[model], attn_implementation=attn, add_pooling_layer=False)
        MODELS[key] = m.eval().float()
    return MODELS[key]


def make_encode(m: torch.nn.Module):
    def encode(ids, mask, types):
        hidden = m(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        w = mask.to(hidden.dtype).unsqueeze(-1)
        mean = (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)
        return torch.nn.functional.normalize(mean, p=2.0, dim=-1, eps=1e-12)

    return encode


def autocast(fn, mode: str):
    if not mode:
        return fn
    if mode != "bf16":
        raise ValueError(f"autocast {mode!r}: only 'bf16'")

    def run(*args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(*args).float()

    return run


def build(impl: str, model: str, mode: str = ""):
    """A fresh callable per (impl, shape): torch.compile(dynamic=False) specialises on
    shape anyway, and a fresh wrapper makes the first call the whole per-shape cost.
    Under autocast, torch.compile traces the autocast region (inductor lowers it to bf16)."""
    if mode:
        if impl.startswith("compile-"):
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = 64
            opts = {"compile-default": None, "compile-max-autotune": "max-autotune-no-cudagraphs"}[impl]
            return torch.compile(autocast(make_encode(module(model, "sdpa")), mode), dynamic=False, mode=opts)
        return autocast(build(impl, model), mode)
    if impl == "eager-sdpa":
        return make_encode(module(model, "sdpa"))
    if impl == "eager-eager":
        return make_encode(module(model, "eager"))
    if impl.startswith("compile-"):
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 64
        mode = {"compile-default": None, "compile-max-autotune": "max-autotune-no-cudagraphs"}[impl]
        return torch.compile(make_encode(module(model, "sdpa")), dynamic=False, mode=mode)
    raise ValueError(impl)


def handle(req: dict) -> dict:
    cmd = req["cmd"]
    if cmd == "load":
        DIRS[req["model"]] = req["dir"]
        module(req["model"], "sdpa")
        return {"ok": True, "torch": torch.__version__, "threads": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}
    if cmd == "setup":
        ids = torch.tensor(req["ids"], dtype=torch.long)
        mask = torch.tensor(req["mask"], dtype=torch.long)
        b, s = ids.shape
        INPUTS[(req["model"], b, s)] = (ids, mask, torch.zeros_like(ids))
        t0 = time.perf_counter()
        impl, mode = req["impl"], req.get("autocast", "")
        if impl.startswith("f32:"):  # a float32 reference beside autocast runs, e.g. "f32:eager-sdpa"
            impl, mode = impl[4:], ""
        fn = build(impl, req["model"], mode)
        with torch.inference_mode():
            out = fn(*INPUTS[(req["model"], b, s)])
        first = time.perf_counter() - t0
        CALLABLES[(req["impl"], req["model"], b, s)] = fn
        return {"first_seconds": first, "embedding": out.numpy().tolist()}
    if cmd == "time":
        key = (req["impl"], req["model"], req["batch"], req["seq"])
        fn = CALLABLES[key]
        args = INPUTS[(req["model"], req["batch"], req["seq"])]
        secs, cpu = [], []
        with torch.inference_mode():
            for _ in range(req["reps"]):
                c0, t0 = time.process_time(), time.perf_counter()
                fn(*args)
                secs.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        return {"seconds": secs, "cpu_seconds": cpu}
    if cmd == "drop":
        CALLABLES.pop((req["impl"], req["model"], req["batch"], req["seq"]), None)
        return {"ok": True}
    if cmd == "matmul":
        n = req["n"]
        a, b = torch.rand(n, n), torch.rand(n, n)
        a @ b
        out, per_cpu = [], []
        for _ in range(req["reps"]):
            c0, t0 = time.process_time(), time.perf_counter()
            a @ b
            out.append(2 * n**3 / (time.perf_counter() - t0) / 1e9)
            per_cpu.append(2 * n**3 / max(time.process_time() - c0, 1e-9) / 1e9)
        return {"gflops": out, "gflops_per_cpu_second": per_cpu}
    raise ValueError(f"unknown command {cmd!r}")


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the protocol
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req["cmd"] == "quit":
            break
        try:
            resp = handle(req)
        except Exception as e:  # report, keep serving: one failing impl must not end the run
            log(traceback.format_exc())
            resp = {"error": f"{type(e).__name__}: {e}"[:2000]}
        out.write(json.dumps(resp) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
