"""ToMe bipartite soft matching and size-weighted merging (jaxserve/models/tome.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.models.tome import MergePlan, bipartite_soft_matching, clamp_merge_r, merge_wavg
from jaxserve.models.vit import VIT_CONFIGS, ViT, gamma_settings, token_counts

CONFIG = VIT_CONFIGS["vit-tiny-test"]
forward = nnx.jit(ViT.__call__, static_argnames=("merge_r", "return_tokens"))
match = jax.jit(bipartite_soft_matching, static_argnums=(1, 2))
merge = jax.jit(merge_wavg)


@pytest.fixture(scope="module")
def model():
    return ViT(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def pixels():
    return jax.random.normal(jax.random.key(1), (2, CONFIG.image_size, CONFIG.image_size, CONFIG.num_channels))


def test_r_zero_is_exactly_no_merging(model, pixels):
    plain = forward(model, pixels)["logits"]
    zeros = forward(model, pixels, merge_r=(0,) * CONFIG.num_layers)["logits"]
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(zeros))


def test_merging_changes_output_and_token_count(model, pixels):
    merge_r = (3, 2)
    out = forward(model, pixels, merge_r=merge_r, return_tokens=True)
    assert out["tokens"].shape[1] == 1 + CONFIG.num_patches - 5 == token_counts(CONFIG, merge_r)[-1]
    assert not np.allclose(np.asarray(out["logits"]), np.asarray(forward(model, pixels)["logits"]))


@pytest.mark.parametrize("num_protected", [1, 4])
def test_protected_tokens_never_merged(num_protected):
    # Every token identical: the protected prefix would be the most similar match for anyone if allowed.
    metric = jnp.ones((2, 17, 8))
    r = clamp_merge_r(100, 17, num_protected)
    plan = match(metric, 100, num_protected)
    assert plan.src_idx.shape == (2, r)
    prefix = np.asarray(plan.kept_idx[:, :num_protected])
    np.testing.assert_array_equal(prefix, np.tile(np.arange(num_protected), (2, 1)))  # stay in place
    assert np.all(np.asarray(plan.src_idx) >= num_protected)  # never a source
    assert np.all(np.asarray(plan.dst_slot) >= num_protected)  # never a destination


def test_cls_row_untouched_by_merge():
    x = jax.random.normal(jax.random.key(0), (1, 9, 4))
    x = x.at[:, 0].set(x[:, 1])  # CLS identical to a patch token: the best possible match
    new_x, size = merge(match(x, 4, num_protected=1), x, jnp.ones((1, 9)))
    np.testing.assert_allclose(np.asarray(new_x[0, 0]), np.asarray(x[0, 0]), rtol=1e-6)
    assert float(size[0, 0]) == 1.0


def test_sizes_sum_to_original_count():
    x = jax.random.normal(jax.random.key(0), (3, 17, 6))
    size = jnp.ones((3, 17))
    for r in (5, 3, 2):  # merge repeatedly, as successive layers do
        x, size = merge(match(x, r, num_protected=1), x, size)
    assert x.shape == (3, 17 - 10, 6)
    np.testing.assert_allclose(np.asarray(size.sum(axis=1)), 17.0)


def test_identical_tokens_merge_into_same_token_with_size_two():
    x = jnp.eye(7)[None] * 3.0  # orthogonal tokens: cosine similarity 0 between distinct ones
    x = x.at[0, 4].set(x[0, 3])  # token 3 (set A) and token 4 (set B) identical: similarity 1
    new_x, size = merge(match(x, 1, num_protected=1), x, jnp.ones((1, 7)))
    merged_rows = np.flatnonzero(np.asarray(size[0]) == 2)
    assert len(merged_rows) == 1 and new_x.shape[1] == 6
    np.testing.assert_allclose(np.asarray(new_x[0, merged_rows[0]]), np.asarray(x[0, 3]), rtol=1e-6)


def test_weighted_average_uses_sizes():
    x = jnp.array([[[0.0], [1.0], [5.0]]])
    size = jnp.array([[1.0, 3.0, 1.0]])
    plan = MergePlan(kept_idx=jnp.array([[0, 2]]), src_idx=jnp.array([[1]]), dst_slot=jnp.array([[1]]))
    new_x, new_size = merge(plan, x, size)
    np.testing.assert_allclose(np.asarray(new_x[0, :, 0]), [0.0, (3 * 1.0 + 5.0) / 4])
    np.testing.assert_allclose(np.asarray(new_size[0]), [1.0, 4.0])


def test_r_is_clamped():
    assert clamp_merge_r(100, 17, 1) == 8
    assert clamp_merge_r(3, 17, 1) == 3
    assert clamp_merge_r(5, 3, 3) == 0  # nothing mergeable
    assert match(jnp.ones((1, 17, 4)), 100).kept_idx.shape == (1, 9)


def test_model_clamps_large_r(model, pixels):
    out = forward(model, pixels, merge_r=(100, 100), return_tokens=True)
    assert out["tokens"].shape[1] == token_counts(CONFIG, (100, 100))[-1] == 5  # 17 -> 9 -> 5


def test_gamma_settings():
    assert gamma_settings(CONFIG, 4) == ((), 4)
    assert gamma_settings(CONFIG, 0) == ((), 0)
    assert gamma_settings(CONFIG, -3) == ((3, 3), 0)
    merge_r, num_prompts = gamma_settings(CONFIG, -100)  # clamped by the bipartite limit: 16 -> 8 -> 4
    assert num_prompts == 0 and merge_r == (8, 4)
    merge_r, _ = gamma_settings(CONFIG, -100, min_patch_tokens=6)  # clamped by the floor: 16 -> 8 -> 6
    assert merge_r == (8, 2) and token_counts(CONFIG, merge_r)[-1] == 1 + 6
    b16 = VIT_CONFIGS["vit-b16"]
    merge_r, _ = gamma_settings(b16, -16)  # ToMe's ViT-B r=16: its own clamp bites in the last layer
    assert merge_r == (16,) * 11 + (10,) and token_counts(b16, merge_r)[-1] == 1 + 196 - 176 - 10


def test_merge_clamped_to_zero_is_identity(pixels):
    # 6 layers at r=8: 17 -> 9 -> 5 -> 3 -> 2, then one mergeable token (set B empty), so r clamps to 0.
    config = dataclasses.replace(CONFIG, num_layers=6)
    merge_r = (8,) * 6
    assert token_counts(config, merge_r) == (9, 5, 3, 2, 2, 2)
    deep = ViT(config, rngs=nnx.Rngs(0))
    out = forward(deep, pixels, merge_r=merge_r, return_tokens=True)
    assert out["tokens"].shape[1] == 2
    # The layers whose r clamps to 0 change nothing: same as not asking them to merge.
    same = forward(deep, pixels, merge_r=(8, 8, 8, 8, 0, 0), return_tokens=True)
    np.testing.assert_array_equal(np.asarray(out["logits"]), np.asarray(same["logits"]))

    x = jax.random.normal(jax.random.key(0), (2, 2, 4))
    size = jnp.array([[1.0, 3.0], [2.0, 5.0]])
    plan = match(x, 8, 1)
    assert plan.src_idx.shape == (2, 0)
    new_x, new_size = merge(plan, x, size)
    np.testing.assert_array_equal(np.asarray(new_x), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(new_size), np.asarray(size))
