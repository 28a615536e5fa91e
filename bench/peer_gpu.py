"""Our AOT BERT executables against PyTorch eager and torch.compile on a GPU.

The GPU counterpart of ``bench/peer.py`` (which is the CPU question of issue #2). It runs
on a GPU host whose Python has both jax[cuda] and torch + transformers (the lent device
machines do); jaxserve itself never imports torch. Both sides in one process, the same
random weights (``export_hf_bert`` writes them in HF layout for ``BertModel``), the same
token ids already on the device, strict float32 on both sides (JAX matmul precision
"highest", torch TF32 off), the same output (mean pooling over real tokens, L2 norm).

Timing: rounds interleave the implementations; in a round each one runs back to back
``reps`` times (about ``--min-seconds``) and then synchronises, so a number is the time
per call of a stream of calls (launch overhead included, host-device transfers not).
Reported: median over rounds, and speed-ups as the median of same-round ratios.

    python -m bench.peer_gpu [--models minilm-l6,bert-base] [--batches 8,32] [--lengths 32,64,128,256]
        [--out FILE]     # the markdown section, to splice in locally: python -m bench.common splice FILE
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/peer_gpu.py", "jaxserve/models", "jaxserve/kernels", "jaxserve/polymorph.py",
    "jaxserve/servables.py", "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
GPU_SECTIONS = {
    "peer_gpu": "--models minilm-l6,bert-base --cudagraphs --rounds 5 --out FILE",
    "peer_gpu_bert": "--models bert-base --cudagraphs --rounds 3 --key peer_gpu_bert --out FILE",
    "peer_gpu_tf32": "--models minilm-l6,bert-base --cudagraphs --rounds 3 --precision default --key peer_gpu_tf32 --out FILE",
}  # measured on a GPU host; never run by bench.all

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import bert_flops, bert_inputs, table  # noqa: E402
from jaxserve.models.bert import BERT_CONFIGS, export_hf_bert, init_bert  # noqa: E402
from jaxserve.polymorph import PolymorphTable  # noqa: E402
from jaxserve.sched.base import Cell, ShapeGrid  # noqa: E402
from jaxserve.servables import bert_servable, weights_of  # noqa: E402


def torch_encoder(hf_dir: Path, attn: str, mode: str | None):
    """HF BertModel + mean pooling + L2 norm; ``mode``: None (eager), "default" or another torch.compile mode."""
    import torch
    from transformers import BertModel

    m = BertModel.from_pretrained(hf_dir, attn_implementation=attn, add_pooling_layer=False).cuda().eval().float()

    def encode(ids, mask):
        hidden = m(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).last_hidden_state
        w = mask.to(hidden.dtype).unsqueeze(-1)
        mean = (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)
        return torch.nn.functional.normalize(mean, p=2.0, dim=-1, eps=1e-12)

    if mode is None:
        return encode
    return torch.compile(encode, dynamic=False, mode=None if mode == "default" else mode)


def stream_seconds(call, sync, min_seconds: float, reps: int | None) -> tuple[float, int]:
    """Seconds per call over a back-to-back stream of ``reps`` calls (sized on the first use)."""
    if reps is None:
        t0 = time.perf_counter()
        call()
        sync()
        reps = max(3, min(200, int(min_seconds / max(time.perf_counter() - t0, 1e-5))))
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = call()
    sync(out)
    return (time.perf_counter() - t0) / reps, reps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="minilm-l6,bert-base")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--lengths", default="32,64,128,256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-seconds", type=float, default=0.2)
    ap.add_argument("--cudagraphs", action="store_true",
                    help="also torch.compile(mode='reduce-overhead'): CUDA graphs, the strongest launch-bound peer")
    ap.add_argument("--precision", choices=("highest", "default"), default="highest",
                    help="highest: strict float32 on both sides; default: each side's default, i.e. TF32 "
                         "matmuls (torch allow_tf32 on, JAX's default precision)")
    ap.add_argument("--key", default="peer_gpu", help="RESULTS.md section")
    ap.add_argument("--out", default="", help="write the RESULTS.md section here")
    args = ap.parse_args()

    import torch

    import torch._dynamo

    # every cell builds fresh compiled wrappers of one encode function: without a higher limit
    # dynamo stops recompiling after 8 shapes and silently runs the rest eagerly
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.cache_size_limit = 1024
    strict = args.precision == "highest"
    torch.backends.cuda.matmul.allow_tf32 = not strict
    torch.backends.cudnn.allow_tf32 = not strict
    torch.set_grad_enabled(False)
    if strict:
        jax.config.update("jax_default_matmul_precision", "highest")
    batches = [int(x) for x in args.batches.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    peers = {"eager": None, "compile": "default"} | ({"compile-ro": "reduce-overhead"} if args.cudagraphs else {})
    titles = {"eager": "eager (sdpa)", "compile": "torch.compile", "compile-ro": "torch.compile reduce-overhead"}
    rows, ratios = [], {k: [] for k in peers}
    warm = {"ours": 0.0} | {k: 0.0 for k in peers if k != "eager"}
    tmp = Path(tempfile.mkdtemp())
    models = args.models.split(",")
    n_cells = len(models) * len(batches) * len(lengths)

    def report(show: bool) -> None:
        """(``--out``) write, and with ``show`` print, the section for the cells measured so far:
        written after every cell, so a run cut short by a GPU host's time limit still leaves them."""
        geo = {k: float(np.exp(np.mean(np.log(v)))) for k, v in ratios.items()}
        text = table(["model", "B", "S", "ours ms", *(f"{titles[k]} ms" for k in peers),
                      *(f"ours vs {titles[k]}" for k in peers),
                      "TFLOP/s ours / " + " / ".join(titles[k] for k in peers), "max |Δemb|"], rows)
        notes = ("Geometric means (>1: ours faster): "
                 + ", ".join(f"vs {titles[k]} **{geo[k]:.2f}×**" for k in peers)
                 + f"; ≥ 1.3× eager in {sum(r >= 1.3 for r in ratios['eager'])}/{len(rows)} cells, "
                 f"≥ 1.0× torch.compile in {sum(r >= 1.0 for r in ratios['compile'])}/{len(rows)}.  \n"
                 "Time to every first result: " + ", ".join(
                     f"{'ours (AOT compile per cell)' if k == 'ours' else titles[k]} {v:.1f} s" for k, v in warm.items())
                 + ".  \n"
                 + ("Strict float32 on both sides (JAX matmul precision 'highest', torch TF32 off)" if strict else
                    "TF32 matmuls on both sides (JAX's default precision, torch allow_tf32 on)")
                 + f"; random weights, the "
                 f"same on both sides; the last row of every batch half padding; torch {torch.__version__}, "
                 f"transformers eager = attn_implementation 'sdpa'. Per call of a back-to-back stream of calls, "
                 f"median of {args.rounds} interleaved rounds; ratios are medians of same-round ratios."
                 + ("" if len(rows) == n_cells else
                    f"  \n**Partial:** {len(rows)} of {n_cells} cells ({', '.join(models)}) measured (the run stopped)."))
        if show:
            print(text)
            print(notes)
        if args.out:
            from bench.common import section

            title = "Peer on a GPU: ours vs PyTorch eager and torch.compile" + ("" if strict else " (TF32)")
            Path(args.out).write_text(section(args.key, title, text, notes))

    for name in models:
        cfg = BERT_CONFIGS[name]
        model = init_bert(cfg, seed=0)
        export_hf_bert(model, tmp / name)
        weights = weights_of(model)
        table_ = PolymorphTable(bert_servable(name, cfg, ShapeGrid(tuple(batches), tuple(lengths))))
        eager = torch_encoder(tmp / name, "sdpa", None)
        for b in batches:
            for s in lengths:
                cell = Cell(b, s)
                ids, mask = bert_inputs(cfg, b, s)
                j_ids, j_mask = jax.device_put(ids), jax.device_put(mask)
                t_ids, t_mask = torch.tensor(ids, dtype=torch.long).cuda(), torch.tensor(mask, dtype=torch.long).cuda()
                t0 = time.perf_counter()
                table_.warm_cell(cell)
                exe = table_.executable(cell)
                ours_emb = np.asarray(exe(weights, j_ids, j_mask)["embedding"])
                warm["ours"] += time.perf_counter() - t0
                fns, diff = {}, 0.0
                for k, mode in peers.items():
                    t0 = time.perf_counter()
                    fns[k] = eager if mode is None else torch_encoder(tmp / name, "sdpa", mode)
                    emb = fns[k](t_ids, t_mask).cpu().numpy()
                    if k in warm:
                        warm[k] += time.perf_counter() - t0
                    diff = max(diff, float(np.abs(ours_emb - emb).max()))
                calls = {"ours": (lambda: exe(weights, j_ids, j_mask)["embedding"],
                                  lambda out=None: jax.block_until_ready(out))}
                for k, fn in fns.items():
                    # reduce-overhead reuses its output buffers: clone so a stream of calls is legal
                    calls[k] = (lambda fn=fn: fn(t_ids, t_mask).clone(), lambda out=None: torch.cuda.synchronize())
                reps, per_round = {}, {k: [] for k in calls}
                for rnd in range(args.rounds):
                    order = list(calls)[rnd % len(calls):] + list(calls)[: rnd % len(calls)]
                    for k in order:
                        secs, reps[k] = stream_seconds(*calls[k], args.min_seconds, reps.get(k))
                        per_round[k].append(secs)
                med = {k: float(np.median(v)) for k, v in per_round.items()}
                ours_t = np.array(per_round["ours"])
                row_ratios = {k: float(np.median(np.array(per_round[k]) / ours_t)) for k in peers}
                for k, r in row_ratios.items():
                    ratios[k].append(r)
                tf = bert_flops(cfg, b, s) / 1e12
                rows.append([name, b, s, f"{med['ours'] * 1e3:.2f}", *(f"{med[k] * 1e3:.2f}" for k in peers),
                             *(f"{row_ratios[k]:.2f}×" for k in peers),
                             " / ".join(f"{tf / med[k]:.1f}" for k in ["ours", *peers]), f"{diff:.1e}"])
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
                report(show=len(rows) == n_cells)


if __name__ == "__main__":
    main()
