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


def weights_of(model: nnx.Module):
    """The weights pytree a servable's executables take as their first argument."""
    return nnx.split(model)[1]
