"""Servables: each model family's grid, compiled function and input shapes, as data."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxserve.models.bert import BertConfig, abstract_bert, make_encode_fn
from jaxserve.models.precision import matmul_weights
from jaxserve.polymorph import Servable, ynn_off
from jaxserve.sched.base import Cell, ShapeGrid


def bert_servable(name: str, cfg: BertConfig, grid: ShapeGrid, precision: str = "f32",
                  importance: bool = False) -> Servable:
    """Text encoder cells (batch, seq bucket) -> {'embedding', 'cls'} per row.

    ``cfg`` may be a BERT or an MPNet (``cfg.family``): the same executables' code, keyed
    apart by ``cfg.key()`` (which names the family and its relative-position buckets). MPNet's
    relative-position bias goes through the fused CPU kernel's position-bias target where
    the kernel is in use (``jaxserve.kernels``), and the attention implementation is part of
    every cache key either way. Buckets up to ``cfg.max_length`` (MPNet: 512).

    ``precision`` "bf16" takes bfloat16 dense kernels (jaxserve.models.precision); its
    weights must be cast the same way (:func:`weights_of`). ``importance``: the cells also
    output ``_importance`` [B, S], Tabi's attention importance vector (a cascade's first level).
    """
    if grid.max_length > cfg.max_length:
        raise ValueError(f"bucket {grid.max_length} exceeds the {cfg.max_length} positions of the model")
    graphdef, abstract_state = abstract_bert(cfg)
    abstract_state = matmul_weights(abstract_state, precision)
    encode = make_encode_fn(graphdef, importance=importance)

    def specs(cell: Cell):
        tok = jax.ShapeDtypeStruct((cell.batch, cell.seq), np.int32)
        return (tok, tok)

    return Servable(
        name=name, config_hash=cfg.key() + ("-importance" if importance else ""), grid=grid,
        abstract_state=abstract_state, fn_for=lambda cell: encode, input_specs=specs,
        options_of=bert_options if precision == "f32" else bert_bf16_options, precision=precision,
        option_candidates=ynn_candidates if precision == "f32" else ynn_bf16_candidates,
        attention_alternative=(lambda cell: False) if importance else short_text_cell,
        stage_servable=lambda start, stop: bert_stage_servable(name, cfg, grid, start, stop, precision),
    )


def stage_name(model: str, start: int, stop: int) -> str:
    """A stage servable's name, its range included (``jaxserve.sched.base.Stage.label``): the
    cache keys name it, so two ranges of one model never share an entry."""
    return f"{model}[{start}:{stop}]"


def bert_stage_servable(name: str, cfg: BertConfig, grid: ShapeGrid, start: int, stop: int,
                        precision: str = "f32") -> Servable:
    """Layers [start, stop) of ``name`` (``BertStage``) over the whole model's grid and options.

    Cells (batch, seq bucket): ``fn(weights, x, mask)`` where x is the token ids [B, S] (first
    stage) or the hidden states [B, S, D] float32; returns ``{'hidden'}``, or from the last
    stage the whole model's ``{'embedding', 'cls'}``. Keyed by name and variant, both naming
    the range."""
    from jaxserve.models.bert import abstract_bert_stage, make_bert_stage_fn

    if grid.max_length > cfg.max_length:
        raise ValueError(f"bucket {grid.max_length} exceeds the {cfg.max_length} positions of the model")
    graphdef, abstract_state = abstract_bert_stage(cfg, start, stop)
    stage = make_bert_stage_fn(graphdef, last=stop == cfg.num_layers)

    def specs(cell: Cell):
        mask = jax.ShapeDtypeStruct((cell.batch, cell.seq), np.int32)
        x = mask if start == 0 else jax.ShapeDtypeStruct((cell.batch, cell.seq, cfg.hidden_size), np.float32)
        return (x, mask)

    return Servable(
        name=stage_name(name, start, stop), config_hash=cfg.key(), grid=grid,
        abstract_state=matmul_weights(abstract_state, precision), fn_for=lambda cell: stage, input_specs=specs,
        variant_of=lambda cell: f"layers={start}:{stop}/{cfg.num_layers}",
        options_of=bert_options if precision == "f32" else bert_bf16_options, precision=precision,
        option_candidates=ynn_candidates if precision == "f32" else ynn_bf16_candidates,
        attention_alternative=short_text_cell,
    )


ATTENTION_TUNING_MAX_SEQ = 64


def short_text_cell(cell: Cell) -> bool:
    """Where warmup's attention tuning (``--tune-attention``) also times attention as XLA ops
    against the fused kernel: text buckets of <= 64 tokens. Measured on the 2-core EPYC
    (bench/RESULTS.md, ``peer``, 2026-11-25: ``ours/xla-attn``), XLA's ops were 3-4% faster in
    3 of the 4 cells of 32 tokens and slower in every cell of 64 to 256 (by 2-24%, more the
    longer): beyond 64 tokens the second form is not worth its compiles."""
    return cell.seq <= ATTENTION_TUNING_MAX_SEQ


def ynn_candidates(cell: Cell) -> tuple[dict[str, str], ...]:
    """What a tuning table times per float32 cell (PolymorphTable): YNNPACK's fusions on, or
    off. Which wins depends on the CPU as much as on the cell (``bert_options``,
    ``vit_options``)."""
    return ynn_off(False), ynn_off(True)


def ynn_bf16_candidates(cell: Cell) -> tuple[dict[str, str], ...]:
    """bf16 cells choose between every YNN fusion and YNN for single dots only; never YNN
    off, which runs bf16 dots slower than float32 (``bert_bf16_options``)."""
    return ynn_off(False), ynn_off(True, keep=("INDIVIDUAL_DOT",))


def bert_bf16_options(cell: Cell) -> dict[str, str]:
    """bf16 cells need YNNPACK: it is what runs bf16 x bf16 -> f32 dots on the CPU's bf16
    units (with YNN off, XLA's own dot runs them slower than float32). From 4096 rows
    (batch x bucket) on, as for float32, YNN's big fusions lose, so those cells keep YNN for
    single dots only; below, all fusions win (measurements: bench/RESULTS.md, 'The
    measurements behind the code's rules')."""
    return ynn_off(cell.batch * cell.seq >= 4096, keep=("INDIVIDUAL_DOT",))


def bert_options(cell: Cell) -> dict[str, str]:
    """The fixed rule, for tables that do not tune: YNNPACK off for cells of >= 4096 rows
    (batch x bucket) on the CPU.

    From 4096 rows, XLA's YNN pass merges each layer's attention-out projection, residual,
    LayerNorm, MLP and second LayerNorm into one fusion, which runs slower than XLA's own
    emitters; below, YNN keeps its smaller fusions and wins or ties. Outputs agree either
    way. The rule was fitted on a 2-core Xeon; where the threshold lies depends on the
    machine and its state, which is why warmup measures it by default (PolymorphTable)
    (measurements: bench/RESULTS.md, 'The measurements behind the code's rules').
    """
    return ynn_off(cell.batch * cell.seq >= 4096)


def vit_servable(name: str, cfg, grid: ShapeGrid, prompt_mode: str = "replace",
                 num_classes: int | None = None, precision: str = "f32") -> Servable:
    """Image classifier cells (batch, gamma) -> {'logits' [B, num_classes], 'cls' [B, D]}.

    One executable per (gamma, batch size), as OTAS serves (§III-B): gamma's token settings
    (``gamma_settings``: a ToMe merge schedule for gamma < 0, gamma deep prompts per layer for
    gamma > 0) are static; everything per task is an argument gathered per sample, so a
    mixed-task batch runs in one executable:

    * gamma <= 0: ``fn(weights, pixels [B,H,W,C], head_w [B,D,C], head_b [B,C])``
    * gamma > 0:  ``fn(weights, pixels, prompts [B,L,gamma,D], head_w, head_b)``

    ``num_classes`` (C) is the widest task's class count (default: the backbone's own head);
    narrower heads are zero-padded by the prompt repository and sliced by the runtime.
    ``precision`` as for :func:`bert_servable` (the task heads and prompts stay float32).
    ``prompt_mode`` is the repository's ('replace' = VPT-deep, the default: cheaper at equal
    accuracy, measured in training/train_prompts.py's docstring). The cache key names gamma,
    the merge schedule, the prompt count, the mode and C, so no two variants share an entry.
    """
    from jaxserve.models.vit import abstract_vit, gamma_settings, make_vit_fn

    graphdef, abstract_state = abstract_vit(cfg)
    abstract_state = matmul_weights(abstract_state, precision)
    classes = int(num_classes or cfg.num_classes)

    def fn_for(cell: Cell):
        merge_r, num_prompts = gamma_settings(cfg, cell.gamma)
        forward = make_vit_fn(graphdef, merge_r=merge_r, num_prompts=num_prompts, prompt_mode=prompt_mode)
        if num_prompts:
            return lambda state, pixels, prompts, head_w, head_b: forward(state, pixels, prompts, head_w, head_b)
        return lambda state, pixels, head_w, head_b: forward(state, pixels, None, head_w, head_b)

    def specs(cell: Cell):
        b, d = cell.batch, cfg.hidden_size
        pixels = jax.ShapeDtypeStruct((b, cfg.image_size, cfg.image_size, cfg.num_channels), np.float32)
        heads = (jax.ShapeDtypeStruct((b, d, classes), np.float32), jax.ShapeDtypeStruct((b, classes), np.float32))
        _, num_prompts = gamma_settings(cfg, cell.gamma)
        if num_prompts:
            return (pixels, jax.ShapeDtypeStruct((b, cfg.num_layers, num_prompts, d), np.float32), *heads)
        return (pixels, *heads)

    def variant(cell: Cell) -> str:
        merge_r, num_prompts = gamma_settings(cfg, cell.gamma)
        return f"gamma={cell.gamma}:merge={merge_r}:prompts={num_prompts}:{prompt_mode}:classes={classes}"

    return Servable(
        name=name, config_hash=cfg.key(), grid=grid, abstract_state=abstract_state,
        fn_for=fn_for, input_specs=specs, variant_of=variant,
        options_of=vit_options if precision == "f32" else vit_bf16_options, precision=precision,
        option_candidates=ynn_candidates if precision == "f32" else ynn_bf16_candidates,
        stage_servable=lambda start, stop: vit_stage_servable(name, cfg, grid, start, stop, prompt_mode, classes,
                                                              precision),
    )


def vit_stage_servable(name: str, cfg, grid: ShapeGrid, start: int, stop: int, prompt_mode: str = "replace",
                       num_classes: int | None = None, precision: str = "f32") -> Servable:
    """Layers [start, stop) of ``name`` (``ViTStage``) over the whole model's grid and options.

    Cells (batch, gamma), arguments in this order, each only where it applies:
    ``fn(weights, x, size, prompts, head_w, head_b)``. x: pixels (first stage) or the tokens
    [B, N, D] entering layer ``start``, N being the count layer ``start - 1`` left at this
    gamma (``token_counts``); size [B, N]: the ToMe sizes (later stages, where gamma's
    schedule merges anywhere); prompts [B, stop - start, P, D]: this stage's layers' prompts
    (gamma > 0); head_w, head_b: the per-sample head (last stage). Returns ``{'hidden',
    'size'}`` (size where merging), or from the last stage the whole model's ``{'logits',
    'cls'}``. Keyed by name and variant, both naming the range."""
    from jaxserve.models.vit import abstract_vit_stage, gamma_settings, make_vit_stage_fn, token_counts

    graphdef, abstract_state = abstract_vit_stage(cfg, start, stop)
    classes = int(num_classes or cfg.num_classes)
    last = stop == cfg.num_layers

    def settings(cell: Cell) -> tuple[tuple[int, ...], int, bool]:
        merge_r, num_prompts = gamma_settings(cfg, cell.gamma)
        return merge_r, num_prompts, start > 0 and any(merge_r)

    def fn_for(cell: Cell):
        merge_r, num_prompts, sized = settings(cell)
        forward = make_vit_stage_fn(graphdef, merge_r=merge_r, num_prompts=num_prompts, prompt_mode=prompt_mode)

        def fn(state, x, *rest):
            rest = list(rest)
            size = rest.pop(0) if sized else None
            prompts = rest.pop(0) if num_prompts else None
            head_w, head_b = rest if last else (None, None)
            return forward(state, x, size, prompts, head_w, head_b)

        return fn

    def specs(cell: Cell):
        b, d = cell.batch, cfg.hidden_size
        merge_r, num_prompts, sized = settings(cell)
        if start == 0:
            args = [jax.ShapeDtypeStruct((b, cfg.image_size, cfg.image_size, cfg.num_channels), np.float32)]
        else:
            n = token_counts(cfg, merge_r, num_prompts, prompt_mode)[start - 1]
            args = [jax.ShapeDtypeStruct((b, n, d), np.float32)]
            if sized:
                args.append(jax.ShapeDtypeStruct((b, n), np.float32))
        if num_prompts:
            args.append(jax.ShapeDtypeStruct((b, stop - start, num_prompts, d), np.float32))
        if last:
            args += [jax.ShapeDtypeStruct((b, d, classes), np.float32), jax.ShapeDtypeStruct((b, classes), np.float32)]
        return tuple(args)

    def variant(cell: Cell) -> str:
        merge_r, num_prompts, _ = settings(cell)
        return (f"gamma={cell.gamma}:merge={merge_r}:prompts={num_prompts}:{prompt_mode}:classes={classes}"
                f":layers={start}:{stop}/{cfg.num_layers}")

    return Servable(
        name=stage_name(name, start, stop), config_hash=cfg.key(), grid=grid,
        abstract_state=matmul_weights(abstract_state, precision), fn_for=fn_for, input_specs=specs,
        variant_of=variant, options_of=vit_options if precision == "f32" else vit_bf16_options,
        precision=precision, option_candidates=ynn_candidates if precision == "f32" else ynn_bf16_candidates,
    )


def vit_options(cell: Cell) -> dict[str, str]:
    """YNNPACK off for batches of >= 4 images on the CPU.

    Unlike BERT's, the ViT graph gains from XLA's own emitters from small batches on, at
    every model size; the crossover sits at a batch of ~4 whatever the token count, so the
    rule counts images, not rows (measurements: bench/RESULTS.md, 'The measurements behind
    the code's rules').
    """
    return ynn_off(cell.batch >= 4)


def vit_bf16_options(cell: Cell) -> dict[str, str]:
    """bf16 ViT cells keep every YNN fusion at every batch: unlike float32 (YNN off from batch
    4), the bf16 dots need YNNPACK, and its fusions win or tie throughout (measurements:
    bench/RESULTS.md, 'The measurements behind the code's rules')."""
    return {}


def weights_of(model: nnx.Module, precision: str = "f32"):
    """The weights pytree a servable's executables take as their first argument, with the
    dense kernels in ``precision`` (cast once, here, never per call)."""
    return matmul_weights(nnx.split(model)[1], precision)
