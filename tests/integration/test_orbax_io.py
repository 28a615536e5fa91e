"""Checkpoints written on one device topology load on another (jaxserve.orbax_io)."""

import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxserve.orbax_io import restore_here

WRITER = """
import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp, sys
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
tree = {"w": {"a": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x"))),
              "b": jax.device_put(jnp.full((2, 3), 7.0), jax.sharding.SingleDeviceSharding(jax.devices()[1]))}}
with ocp.StandardCheckpointer() as c:
    c.save(sys.argv[1], tree)
"""


def test_a_checkpoint_from_another_topology_restores_on_this_device(tmp_path):
    """Written by a process with two devices (the array split across both, another on the
    second), read by this one-device process: orbax's own restore refuses ("Topology
    mismatch": what a GPU host did with the shipped CPU-written demo ViT and prompts), and
    restore_here gives the arrays on this device, with and without a target tree."""
    import jax

    path = tmp_path / "state"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    subprocess.run([sys.executable, "-c", WRITER, str(path)], check=True, env=env, capture_output=True)
    assert len(jax.devices()) == 1
    with pytest.raises(ValueError, match="[Tt]opology"), ocp.StandardCheckpointer() as c:
        c.restore(path)
    got = restore_here(path)
    np.testing.assert_array_equal(got["w"]["a"], np.arange(8.0))
    np.testing.assert_array_equal(got["w"]["b"], np.full((2, 3), 7.0))
    assert got["w"]["a"].devices() == {jax.devices()[0]}
    target = {"w": {"a": jax.ShapeDtypeStruct((8,), np.float32), "b": jax.ShapeDtypeStruct((2, 3), np.float32)}}
    np.testing.assert_array_equal(restore_here(path, target)["w"]["b"], np.full((2, 3), 7.0))
