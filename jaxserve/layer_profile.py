"""AsyFunc's profiler and extractor (§3.3): how each layer's latency grows with the batch, what
it weighs and how long it takes to load; layer blocks for shadows; the stage costs AsyFunc plans
with.

**Units** (the finest pieces measured): BERT/MPNet ``embeddings``, then per layer ``L{k}.attn``
(QKV, attention, output projection, residual and LayerNorm) and ``L{k}.mlp`` (both dense
layers, GELU, residual and LayerNorm), then ``pool`` (mean and CLS pooling, no parameters);
ViT ``patch_embed`` (patch projection, CLS token, position embeddings), ``L{k}.attn`` (norm1,
attention, LayerScale), ``L{k}.mlp`` (norm2, MLP) and ``head`` (final norm and classifier).
Each unit is its own jitted function over its real input shape (text: one sequence bucket
``seq``; images: the model's), timed at batch sizes 1, 2, 3, 4, 5 and 8 (the paper's 2 -> 3, 4,
5 and ours up to 8: larger batches cost the 2-core machine minutes and no SLO here allows
them). A time is the least of ``repeats`` calls after a warm-up (below, **Cores**).

**Sensitivity** of a unit: its latency increase from batch 2 to batch 4 (the paper's Fig. 2),
in seconds. **Memory**: its parameter bytes. **Load time**: reading its parameters from a file
(in the page cache, so it measures deserialising and placing them, not the disk) and putting
them on the device.

**Cores.** Latency is measured at a fixed core count: :func:`profile_layers` runs each count in
a child process pinned to that many CPUs (``os.sched_setaffinity``; XLA sizes its thread pool
from the process's affinity), so ``cores=(1, 2)`` gives AsyFunc both configurations of this
machine. A call's latency at ``c`` cores is taken as its process CPU time divided by ``c``
(XLA's pool threads compute or spin for the whole call), the least of ``repeats`` calls: the
cores here are shared with other jobs (load averages of 10-15 on 2 cores while this was
written), which inflate wall time many-fold and at random, while CPU time counts only what
the call itself ran. At 1 core that is the latency; at 2 it assumes the call keeps both busy
(an optimistic bound where it does not).

**Blocks** (the extractor): adjacent layers whose sensitivity is within ``tolerance`` of the
block's mean are grouped (a layer is its attention plus its MLP), up to ``max_block_share`` of
the model's bytes a block: a transformer's layers are alike, and without a cap they made one
block of nearly the whole model (DINOv2's ten middle layers: above ``max_share``, dropped, so no
shadow at all), where a shadow should have sizes to choose from. Our engine cuts layer ranges,
and a range starting at layer 0 holds the embeddings (the one ending at L the pooler/head): a
block is charged those units' bytes, load time and sensitivity. A shadow should hold what grows
most with the batch **per byte it loads** (the paper's "most resource-sensitive but
memory-efficient layers"), so the extractor works on a block's density, sensitivity per byte:
an edge layer is cut off a block of several layers when its own density is below ``1 -
tolerance`` of the rest's (MiniLM-L6's layer 0 carries a 47.7 MB embedding table that barely
grows with the batch: a sixth of the other layers' density or less in our profiles), and blocks of less than
``min_share`` of the largest sensitivity, of more than ``max_share`` of the model's bytes, or of
less than ``min_density_share`` of the densest block's density, are dropped. The paper's "very
large memory consumption" has no threshold; ours is relative to what a block buys, since a
large block that grows in proportion is as good a shadow per byte as a small one. The shadow
candidates (``splits``) are the contiguous unions of the remaining blocks taken in decreasing
sensitivity (the paper's order; a shadow holds one layer range), up to ``max_share`` of the
model's bytes.

**Stage costs.** For each split ``[i:j)``, the stages ``[0:i)``, ``[i:j)``, ``[j:L)`` and the
whole model are timed as the engine's stages compute them (``jaxserve.models.bert.BertStage`` /
``ViTStage`` arithmetic) at batch sizes 1, 2, 4 and 8, per core count.

``jaxserve profile --layers --model M`` writes the result into ``<cost model>.layers.json``
next to the cost model (format: :func:`write_layers`), and adds the stage profiles at the
machine's full core count to the cost model itself, so ``jaxserve simulate`` prices stage
batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SENSITIVITY_BATCHES = (1, 2, 3, 4, 5, 8)
STAGE_BATCHES = (1, 2, 4, 8)
TEXT_SEQ = 64  # the bucket profiled: our tweets' lengths sit below it (bench/RESULTS.md, staircase)


@dataclass(frozen=True)
class Unit:
    name: str
    kind: str
    layer: int  # -1: before the layers, num_layers: after them
    param_bytes: int
    load_s: float
    latency: dict  # batch -> seconds

    @property
    def sensitivity(self) -> float:
        return self.latency[4] - self.latency[2]


CLOCKS = ("cpu", "wall")
_clock = "cpu"  # this process's (the child's ``--clock``): what _min_time reads


def _min_time(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of one call at this process's ``c`` cores: the least process CPU time of
    ``repeats`` calls, divided by ``c`` (module docstring: why not the wall clock); under the
    ``wall`` clock the least wall time (for a quiet machine, where it is what a worker pinned to
    ``c`` cores takes, thread-pool hand-offs and idle threads included)."""
    jax.block_until_ready(fn())
    cores = len(os.sched_getaffinity(0))
    wall = _clock == "wall"
    now = time.perf_counter if wall else time.process_time
    best = float("inf")
    for _ in range(repeats):
        t0 = now()
        jax.block_until_ready(fn())
        best = min(best, now() - t0)
    return best if wall else best / cores


def _nbytes(tree) -> int:
    return int(sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree)))


def _load_seconds(tree, repeats: int = 3) -> float:
    """Seconds to read ``tree``'s arrays from an .npz file (page cache) and place them on the
    device: the least process CPU time of ``repeats`` loads (one thread copies; the wall clock
    on the shared cores is not the load's, module docstring)."""
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
    if not leaves:
        return 0.0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "unit.npz"
        np.savez(path, *leaves)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            with np.load(path) as f:
                arrays = [jax.device_put(f[k]) for k in f.files]
            jax.block_until_ready(arrays)
            best = min(best, time.process_time() - t0)
    return best


def _state_of(module) -> nnx.State:
    return nnx.state(module, nnx.Param)


# ------------------------------------------------------------------ text (BERT, MPNet)
def _text_parts(name: str):
    from jaxserve.models.bert import embed_tokens, padding_bias, pool, position_bias
    from jaxserve.registry import load_text_model

    cfg, model, _ = load_text_model(name)
    graphdef, state = nnx.split(model)
    L = cfg.num_layers
    seq = TEXT_SEQ

    def inputs(b):
        rs = np.random.RandomState(b)
        ids = rs.randint(1000, min(cfg.vocab_size, 20000), size=(b, seq)).astype(np.int32)
        return jnp.asarray(ids), jnp.ones((b, seq), jnp.int32)

    @jax.jit
    def embed(state, ids, mask):
        return embed_tokens(nnx.merge(graphdef, state), ids, None, mask)

    def layer_fn(k, half):
        @jax.jit
        def f(state, x, mask):
            m = nnx.merge(graphdef, state)
            layer = m.layers[k]
            if half == "mlp":
                from jaxserve.models.bert import gelu_exact

                return layer.mlp_norm(x + layer.mlp_out(gelu_exact(layer.mlp_in(x))))
            from jaxserve.models.attention import qkv_attention

            b, s, d = x.shape
            h = layer.num_heads
            qkv = layer.qkv(x).reshape(b, s, 3, h, d // h)
            ctx = qkv_attention(qkv, padding_bias(mask, x.dtype), float(1.0 / np.sqrt(d // h)), position_bias(m, s))
            return layer.attn_norm(x + layer.attn_out(ctx.reshape(b, s, d)))
        return f

    @jax.jit
    def pooled(x, mask):
        return pool(x, mask)

    def stage_fn(start, stop):
        @jax.jit
        def f(state, x, mask):
            m = nnx.merge(graphdef, state)
            if start == 0:
                x = embed_tokens(m, x, None, mask)
            kb, pb = padding_bias(mask, x.dtype), position_bias(m, mask.shape[1])
            for layer in m.layers[start:stop]:
                x = layer(x, kb, pb)
            return pool(x, mask) if stop == L else x
        return f

    def hidden(b):
        ids, mask = inputs(b)
        return embed(state, ids, mask), mask

    layers = model.layers
    embed_params = {k: v for k, v in _state_of(model).items() if k not in ("layers",)}
    units = [("embeddings", "embeddings", -1, embed_params, lambda b: (lambda ids, mask: lambda: embed(state, ids, mask))(*inputs(b)))]
    for k in range(L):
        lay = layers[k]
        attn_params = [_state_of(getattr(lay, n)) for n in ("qkv", "attn_out", "attn_norm")]
        mlp_params = [_state_of(getattr(lay, n)) for n in ("mlp_in", "mlp_out", "mlp_norm")]
        fa, fm = layer_fn(k, "attn"), layer_fn(k, "mlp")
        units.append((f"L{k}.attn", "attention", k, attn_params,
                      (lambda f: lambda b: (lambda x, mask: lambda: f(state, x, mask))(*hidden(b)))(fa)))
        units.append((f"L{k}.mlp", "mlp", k, mlp_params,
                      (lambda f: lambda b: (lambda x, mask: lambda: f(state, x, mask))(*hidden(b)))(fm)))
    units.append(("pool", "pool", L, [], lambda b: (lambda x, mask: lambda: pooled(x, mask))(*hidden(b))))

    def stage_call(start, stop, b):
        f = stage_fn(start, stop)
        if start == 0:
            ids, mask = inputs(b)
            return lambda: f(state, ids, mask)
        x, mask = hidden(b)
        return lambda: f(state, x, mask)

    row_bytes = seq * cfg.hidden_size * 4 + seq * 4  # hidden states and mask, float32 / int32
    return dict(name=name, num_layers=L, seq=seq, state=state, units=units, stage_call=stage_call,
                row_bytes=row_bytes, edge_bytes=(_nbytes(embed_params), 0))


# ------------------------------------------------------------------ images (the demo ViT, DINOv2 ViT-S/14)
def _vit_parts(name: str):
    from jaxserve.models.vit import classify, embed_patches, load_vit_checkpoint
    from jaxserve.registry import load_dinov2, vit_demo_dir

    if name == "vit-demo":
        cfg, model = load_vit_checkpoint(vit_demo_dir())
    elif name == "dinov2-s14":
        cfg, model = load_dinov2()  # 224 pixels, 257 tokens; its 10-class head stands for a probe
    else:
        raise KeyError(f"layer profiles cover the ViTs vit-demo and dinov2-s14, not {name!r}")
    graphdef, state = nnx.split(model)
    L = cfg.num_layers

    def pixels(b):
        rs = np.random.RandomState(b)
        return jnp.asarray(rs.rand(b, cfg.image_size, cfg.image_size, cfg.num_channels).astype(np.float32))

    @jax.jit
    def embed(state, px):
        return embed_patches(nnx.merge(graphdef, state), px, ())[0]

    def block_fn(k, half):
        @jax.jit
        def f(state, x):
            blk = nnx.merge(graphdef, state).blocks[k]
            if half == "attn":
                out, _ = blk.attn(blk.norm1(x), None)
                return x + (out * blk.ls1[...] if hasattr(blk, "ls1") else out)
            out = blk.mlp(blk.norm2(x))
            return x + (out * blk.ls2[...] if hasattr(blk, "ls2") else out)
        return f

    @jax.jit
    def head(state, x):
        m = nnx.merge(graphdef, state)
        return classify(m, m.norm(x)[:, 0], None, None)

    def stage_fn(start, stop):
        @jax.jit
        def f(state, x):
            m = nnx.merge(graphdef, state)
            if start == 0:
                x = embed_patches(m, x, ())[0]
            for blk in m.blocks[start:stop]:
                x, _ = blk(x, None, 0, 1)
            return classify(m, m.norm(x)[:, 0], None, None) if stop == L else x
        return f

    def tokens(b):
        return embed(state, pixels(b))

    full = _state_of(model)
    embed_params = [full[k] for k in ("patch_embed", "cls_token", "pos_embed")]
    head_params = [full[k] for k in ("norm", "head")]
    units = [("patch_embed", "patch_embed", -1, embed_params, lambda b: (lambda px: lambda: embed(state, px))(pixels(b)))]
    for k in range(L):
        blk = model.blocks[k]
        attn_params = [_state_of(blk.norm1), _state_of(blk.attn)] + ([blk.ls1] if hasattr(blk, "ls1") else [])
        mlp_params = [_state_of(blk.norm2), _state_of(blk.mlp)] + ([blk.ls2] if hasattr(blk, "ls2") else [])
        for half, params in (("attn", attn_params), ("mlp", mlp_params)):
            f = block_fn(k, half)
            units.append((f"L{k}.{half}", "attention" if half == "attn" else "mlp", k, params,
                          (lambda f: lambda b: (lambda x: lambda: f(state, x))(tokens(b)))(f)))
    units.append(("head", "head", L, head_params, lambda b: (lambda x: lambda: head(state, x))(tokens(b))))

    def stage_call(start, stop, b):
        f = stage_fn(start, stop)
        x = pixels(b) if start == 0 else tokens(b)
        return lambda: f(state, x)

    n_tokens = cfg.num_patches + 1
    return dict(name=name, num_layers=L, seq=0, state=state, units=units, stage_call=stage_call,
                row_bytes=n_tokens * cfg.hidden_size * 4, edge_bytes=(_nbytes(embed_params), _nbytes(head_params)))


def _parts(name: str):
    from jaxserve.registry import IMAGE_MODELS

    return _vit_parts(name) if name in IMAGE_MODELS else _text_parts(name)


# ------------------------------------------------------------------ measuring
def measure_units(name: str, repeats: int = 3, progress: bool = False) -> dict:
    """Every unit's latency per batch, parameter bytes and load time, at this process's cores."""
    parts = _parts(name)
    out = []
    for uname, kind, layer, params, make in parts["units"]:
        lat = {b: _min_time(make(b), repeats) for b in SENSITIVITY_BATCHES}
        out.append(Unit(uname, kind, layer, _nbytes(params), _load_seconds(params), lat))
        if progress:
            print(f"  {uname:12s} {out[-1].param_bytes / 1e6:8.2f} MB  +{out[-1].sensitivity * 1e3:7.3f} ms (2->4)",
                  file=sys.stderr)
    return dict(parts=parts, units=out)


def group_blocks(units: list[Unit], num_layers: int, edge_bytes: tuple[int, int], tolerance: float = 0.25,
                 min_share: float = 0.1, max_share: float = 0.8, min_density_share: float = 0.25,
                 max_block_share: float = 0.25) -> tuple[list[dict], list[dict]]:
    """(blocks, splits): the extractor (module docstring). A block is ``{start, stop,
    sensitivity, bytes, load_s, kept, why}``; a split ``{start, stop, bytes, load_s}``.

    A block's sensitivity, bytes and load time include the edge units its range holds (the
    embeddings for a range from layer 0, the pooler or head for one ending at the last layer).
    Its **density** is sensitivity per byte: what a shadow buys per byte it loads. A group
    stops growing before its layers pass ``max_block_share`` of the model's bytes. An edge
    layer is cut off a block of several layers when its own density (its edge unit's included)
    is below ``1 - tolerance`` of the rest's (or the block holds more than ``max_share`` of the
    model's bytes), and kept as a block of its own, dropped; a block is dropped when its
    density is below ``min_density_share`` of the densest block's (the paper's "very large
    memory consumption", relative to what the block buys)."""
    per_layer = []
    for k in range(num_layers):
        us = [u for u in units if u.layer == k]
        per_layer.append((sum(u.sensitivity for u in us), sum(u.param_bytes for u in us), sum(u.load_s for u in us)))
    total = sum(u.param_bytes for u in units)
    edges = {e: [u for u in units if u.layer == e] for e in (-1, num_layers)}

    def block(start, stop):
        nbytes = sum(per_layer[k][1] for k in range(start, stop))
        load = sum(per_layer[k][2] for k in range(start, stop))
        sens = sum(per_layer[k][0] for k in range(start, stop))
        for edge, inside, nb in ((-1, start == 0, edge_bytes[0]), (num_layers, stop == num_layers, edge_bytes[1])):
            if inside:
                nbytes += nb
                load += sum(u.load_s for u in edges[edge])
                sens += sum(u.sensitivity for u in edges[edge])
        return dict(start=start, stop=stop, sensitivity=sens, bytes=int(nbytes), load_s=load)

    groups: list[list[int]] = []
    for k, (s, _, _) in enumerate(per_layer):
        if groups:
            mean = np.mean([per_layer[i][0] for i in groups[-1]])
            if (abs(s - mean) <= tolerance * max(abs(mean), 1e-12)
                    and block(groups[-1][0], k + 1)["bytes"] <= max_block_share * total):
                groups[-1].append(k)
                continue
        groups.append([k])

    def density(b):
        return b["sensitivity"] / max(b["bytes"], 1)

    def cut_edge(b, first: bool, what: str):
        """(``b`` without its first or last layer, that layer as a dropped block) where the
        layer is less dense than the rest (docstring), else (``b``, None)."""
        start, stop = b["start"], b["stop"]
        if stop - start < 2:
            return b, None
        edge = block(start, start + 1) if first else block(stop - 1, stop)
        inner = block(start + 1, stop) if first else block(start, stop - 1)
        if density(edge) < (1 - tolerance) * density(inner) or b["bytes"] > max_share * total:
            return inner, {**edge, "kept": False, "why": f"{what}: less sensitivity per byte"}
        return b, None

    blocks = []
    for g in groups:
        b = block(g[0], g[-1] + 1)
        head = tail = None
        if b["start"] == 0:
            b, head = cut_edge(b, True, "layer 0 holds the embeddings")
        if b["stop"] == num_layers and edge_bytes[1] > 0:
            b, tail = cut_edge(b, False, f"layer {num_layers - 1} holds the pooler/head")
        blocks += [x for x in (head, b, tail) if x is not None]
    top = max(b["sensitivity"] for b in blocks)
    densest = max(density(b) for b in blocks if "kept" not in b)
    for b in blocks:
        if "kept" in b:
            continue
        if b["bytes"] > max_share * total:
            b.update(kept=False, why=f"memory above {max_share:.0%} of the model")
        elif b["sensitivity"] < min_share * top:
            b.update(kept=False, why=f"sensitivity below {min_share:.0%} of the largest")
        elif density(b) < min_density_share * densest:
            b.update(kept=False, why=f"sensitivity per byte below {min_density_share:.0%} of the densest block's")
        else:
            b.update(kept=True, why="")
    kept = sorted((b for b in blocks if b["kept"]), key=lambda b: -b["sensitivity"])
    splits = []
    lo = hi = None
    for b in kept:
        if lo is None:
            lo, hi = b["start"], b["stop"]
        elif b["stop"] == lo:
            lo = b["start"]
        elif b["start"] == hi:
            hi = b["stop"]
        else:
            continue  # not adjacent to the union so far: a shadow holds one range
        u = block(lo, hi)
        if u["bytes"] > max_share * total:
            break  # a shadow that large is a body
        splits.append(dict(start=lo, stop=hi, bytes=u["bytes"], load_s=u["load_s"]))
    return blocks, splits


def correlation(units: list[Unit]) -> dict:
    """Pearson and Spearman correlation of sensitivity against parameter bytes over the units
    with parameters (the parameter-free pooler says nothing about memory)."""
    us = [u for u in units if u.param_bytes > 0]
    s = np.array([u.sensitivity for u in us])
    m = np.array([u.param_bytes for u in us], dtype=float)

    def pearson(a, b):
        return float(np.corrcoef(a, b)[0, 1]) if np.std(a) > 0 and np.std(b) > 0 else float("nan")

    rank = lambda a: np.argsort(np.argsort(a)).astype(float)  # noqa: E731
    return {"pearson": pearson(s, m), "spearman": pearson(rank(s), rank(m)), "units": len(us)}


def measure_stages(parts: dict, splits: list[dict], repeats: int = 3) -> dict:
    """Seconds per (profile name, batch) of the whole model and of every split's stages."""
    name, L = parts["name"], parts["num_layers"]
    ranges = {(0, L)}
    for sp in splits:
        ranges |= {(sp["start"], sp["stop"])}
        if sp["start"] > 0:
            ranges.add((0, sp["start"]))
        if sp["stop"] < L:
            ranges.add((sp["stop"], L))
    out = {}
    for start, stop in sorted(ranges):
        label = name if (start, stop) == (0, L) else f"{name}[{start}:{stop}]"
        out[label] = {b: _min_time(parts["stage_call"](start, stop, b), repeats) for b in STAGE_BATCHES}
    return out


def profile_here(name: str, repeats: int = 3, progress: bool = False, splits: list[dict] | None = None) -> dict:
    """The whole profile of ``name`` at this process's cores (JSON-ready); ``splits``: time
    these splits' stages instead of the ones this run's blocks give."""
    m = measure_units(name, repeats, progress)
    parts, units = m["parts"], m["units"]
    blocks, own = group_blocks(units, parts["num_layers"], parts["edge_bytes"])
    splits = own if splits is None else splits
    stages = measure_stages(parts, splits, repeats)
    whole_bytes = sum(u.param_bytes for u in units)
    return {
        "model": name, "num_layers": parts["num_layers"], "seq": parts["seq"],
        "cores": len(os.sched_getaffinity(0)),
        "param_bytes": whole_bytes, "load_s": _load_seconds(parts["state"]),
        "row_bytes": parts["row_bytes"],
        "units": [{**asdict(u), "latency": {str(b): t for b, t in u.latency.items()},
                   "sensitivity": u.sensitivity} for u in units],
        "blocks": blocks, "splits": splits, "correlation": correlation(units),
        "stages": {label: {str(b): t for b, t in ts.items()} for label, ts in stages.items()},
    }


def profile_layers(name: str, cores: tuple[int, ...] = (1, 2), repeats: int = 3, progress: bool = False,
                   clock: str = "cpu") -> dict:
    """Profiles of ``name`` at each core count, each in a child process pinned to that many CPUs.
    The blocks and splits of the largest count decide; every count times those splits' stages.
    ``clock``: "cpu" (process CPU time over cores: robust on shared cores) or "wall" (on a quiet
    machine: what a pinned live worker takes)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r}: one of {CLOCKS}")
    available = sorted(os.sched_getaffinity(0))
    runs = {}
    for c in sorted(cores, reverse=True):
        if c > len(available):
            raise ValueError(f"{c} cores asked, {len(available)} available")
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "profile.json"
            cmd = [sys.executable, "-m", "jaxserve.layer_profile", "--model", name, "--repeats", str(repeats),
                   "--json-out", str(out), "--clock", clock]
            if runs:  # the splits the first (largest) count chose
                cmd += ["--splits", json.dumps(runs[max(runs)]["splits"])]
            pinned = set(available[:c])  # inherited through exec, before XLA sizes its thread pool
            subprocess.run(cmd, check=True, preexec_fn=lambda: os.sched_setaffinity(0, pinned),
                           stderr=None if progress else subprocess.DEVNULL)
            runs[c] = json.loads(out.read_text())
    top = runs[max(runs)]
    return {**{k: v for k, v in top.items() if k not in ("stages", "cores")}, "clock": clock,
            "latency": {str(c): r["stages"] for c, r in sorted(runs.items())},
            "units_by_cores": {str(c): r["units"] for c, r in sorted(runs.items())}}


def refresh_load_times(profile: dict) -> dict:
    """``profile`` (of :func:`profile_layers`) with its load times measured again (units, blocks,
    splits, the whole model), its latencies kept: for a profile whose loads were timed by an
    older rule. The blocks must come out as they were (same latencies, same grouping)."""
    name = profile["model"]
    parts = _parts(name)
    loads = {uname: _load_seconds(params) for uname, _, _, params, _ in parts["units"]}
    for rows in (profile["units"], *profile.get("units_by_cores", {}).values()):
        for u in rows:
            u["load_s"] = loads[u["name"]]
    units = [Unit(u["name"], u["kind"], u["layer"], u["param_bytes"], u["load_s"],
                  {int(b): t for b, t in u["latency"].items()}) for u in profile["units"]]
    blocks, splits = group_blocks(units, parts["num_layers"], parts["edge_bytes"])
    if [(s["start"], s["stop"]) for s in splits] != [(s["start"], s["stop"]) for s in profile["splits"]]:
        raise ValueError(f"{name}: the blocks changed: {splits} against {profile['splits']}")
    return {**profile, "blocks": blocks, "splits": splits, "load_s": _load_seconds(parts["state"])}


def layers_path(cost_model_path: str | Path) -> Path:
    """The sibling file of a cost model that holds its layer profiles: ``X.json`` -> ``X.layers.json``."""
    p = Path(cost_model_path)
    return p.with_name(p.stem + ".layers.json")


def write_layers(cost_model_path: str | Path, profile: dict, machine: str = "") -> Path:
    """Merge ``profile`` (of :func:`profile_layers`) into the layer file next to the cost model
    (``{"machine": .., "models": {name: profile}}``), and the stage profiles at the largest core
    count into the cost model itself (created if missing). Returns the layer file."""
    from jaxserve.profiler import machine_description
    from jaxserve.sched.base import Cell, CostModel, LatencyProfile

    cost_path = Path(cost_model_path)
    path = layers_path(cost_path)
    raw = json.loads(path.read_text()) if path.exists() else {"models": {}}
    raw["machine"] = machine or machine_description()
    raw["models"][profile["model"]] = profile
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(raw, indent=1))
    seq = int(profile["seq"])
    top = profile["latency"][max(profile["latency"], key=int)]
    stage_costs = CostModel({label: LatencyProfile(label, {Cell(int(b), seq): float(t) for b, t in ts.items()})
                             for label, ts in top.items() if label != profile["model"]})
    cost = CostModel.from_json(cost_path.read_text()) if cost_path.exists() else CostModel({}, machine=raw["machine"])
    cost_path.write_text(cost.merged(stage_costs).to_json())
    return path


def main(argv: list[str] | None = None) -> int:
    """The child process of :func:`profile_layers` (one core count)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m jaxserve.layer_profile")
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--splits", default=None, help="JSON list of {start, stop, ...}: time these stages")
    ap.add_argument("--clock", choices=CLOCKS, default="cpu")
    args = ap.parse_args(argv)
    global _clock
    _clock = args.clock
    result = profile_here(args.model, args.repeats, progress=True,
                          splits=json.loads(args.splits) if args.splits else None)
    Path(args.json_out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
