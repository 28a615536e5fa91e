"""Servables: each model family's grid, compiled function and input shapes, as data."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxserve.models.bert import BertConfig, abstract_bert, make_encode_fn
from jaxserve.polymorph import Servable
from jaxserve.sched.base import Cell, ShapeGrid


def bert_servable(name: str, cfg: BertConfig, grid: ShapeGrid) -> Servable:
    """Text encoder cells (batch, seq bucket) -> {'embedding', 'cls'} per row."""
    if grid.max_length > cfg.max_position:
        raise ValueError(f"bucket {grid.max_length} exceeds max_position {cfg.max_position}")
    graphdef, abstract_state = abstract_bert(cfg)
    encode = make_encode_fn(graphdef)

    def specs(cell: Cell):
        tok = jax.ShapeDtypeStruct((cell.batch, cell.seq), np.int32)
        return (tok, tok)

    return Servable(
        name=name, kind="text", config_hash=cfg.key(), grid=grid,
        abstract_state=abstract_state, fn_for=lambda cell: encode, input_specs=specs,
    )


def vit_servable(name: str, cfg, grid: ShapeGrid, prompt_mode: str = "replace") -> Servable:
    """Image classifier cells (batch, gamma) -> {'logits', 'cls'}; gamma's token settings
    (ToMe merge schedule or prompt count) are static per executable."""
    from functools import partial

    from jaxserve.models.vit import abstract_vit, gamma_settings, vit_forward

    graphdef, abstract_state = abstract_vit(cfg)
    if any(g > 0 for g in grid.gammas):
        raise NotImplementedError("prompted (gamma > 0) ViT cells need a prompt repository")

    def fn_for(cell: Cell):
        merge_r, _ = gamma_settings(cfg, cell.gamma)
        return partial(vit_forward, graphdef, merge_r=merge_r)

    def specs(cell: Cell):
        return (jax.ShapeDtypeStruct((cell.batch, cfg.image_size, cfg.image_size, cfg.num_channels), np.float32),)

    return Servable(
        name=name, kind="image", config_hash=cfg.key(), grid=grid, abstract_state=abstract_state,
        fn_for=fn_for, input_specs=specs,
        variant_of=lambda cell: f"gamma={cell.gamma}:merge={gamma_settings(cfg, cell.gamma)[0]}",
    )


def weights_of(model: nnx.Module):
    """The weights pytree a servable's executables take as their first argument."""
    return nnx.split(model)[1]
