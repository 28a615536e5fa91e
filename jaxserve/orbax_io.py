"""Reading orbax checkpoints on whatever devices this process has.

An orbax checkpoint records the sharding it was saved with. Restored without a target (or
with one whose leaves carry no sharding), orbax rebuilds that sharding, which fails with
"Topology mismatch" on any other machine: the shipped demo ViT and prompt repository,
written on a CPU host, could not be loaded on a GPU host. Every restore therefore goes
through :func:`restore_here`, which asks for each leaf on this process's default device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax


def restore_here(directory: str | Path, target: Any = None) -> Any:
    """Restore a ``StandardCheckpointer`` tree from ``directory`` onto the default device.

    ``target``: a tree of arrays or ``jax.ShapeDtypeStruct`` (e.g. an ``nnx.eval_shape``
    state) whose structure, shapes and dtypes the result takes; None: the checkpoint's own
    (read from its metadata)."""
    import orbax.checkpoint as ocp

    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as checkpointer:
        if target is None:
            meta = checkpointer.metadata(Path(directory))
            target = getattr(meta, "item_metadata", meta)  # a tree of ArrayMetadata (shape, dtype)
        target = jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=here),
                                        target)
        return checkpointer.restore(Path(directory), target)
