"""ViT forward, OTAS prompting / per-task heads, and timm / HF checkpoint layouts (jaxserve/models/vit.py)."""

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.models.vit import (
    VIT_CONFIGS,
    ViT,
    ViTConfig,
    export_hf_state_dict,
    export_timm_state_dict,
    init_vit,
    load_timm_state_dict,
    load_vit_safetensors,
    make_vit_fn,
    patchify,
    save_safetensors,
    token_counts,
)

CONFIG = VIT_CONFIGS["vit-tiny-test"]
L, D = CONFIG.num_layers, CONFIG.hidden_size
# One compile per static setting instead of op-by-op eager dispatch: keeps the file fast on 2 cores.
forward = nnx.jit(ViT.__call__, static_argnames=("merge_r", "num_prompts", "prompt_mode", "return_tokens"))


@pytest.fixture(scope="module")
def model():
    return init_vit(CONFIG, seed=0)


@pytest.fixture(scope="module")
def pixels():
    return jax.random.normal(jax.random.key(1), (3, CONFIG.image_size, CONFIG.image_size, CONFIG.num_channels))


def _prompts(batch, num_prompts, seed=2):
    return jax.random.normal(jax.random.key(seed), (batch, L, num_prompts, D))


def test_config_key_and_presets():
    # The key's contract, written out by hand for vit-tiny-test: sha256 of every field as JSON with
    # sorted keys, `layer_scale` left out at its default (added after the first keys were stored:
    # compile-cache entries and prompt repositories keyed before it must stay valid).
    blob = ('{"hidden_size": 32, "image_size": 16, "layer_norm_eps": 1e-06, "mlp_dim": 64, "num_channels": 3, '
            '"num_classes": 10, "num_heads": 2, "num_layers": 2, "patch_size": 4}')
    assert CONFIG.key() == hashlib.sha256(blob.encode()).hexdigest()
    # an equal config built separately has that key (nothing per-object in it); layer_scale counts once set
    separate = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_layers=2, num_heads=2,
                         mlp_dim=64, num_classes=10, layer_norm_eps=1e-6, layer_scale=False)
    assert separate is not CONFIG and separate.key() == CONFIG.key()
    assert dataclasses.replace(CONFIG, layer_scale=True).key() != CONFIG.key()
    assert CONFIG.key() != dataclasses.replace(CONFIG, layer_norm_eps=1e-12).key()
    b16 = VIT_CONFIGS["vit-b16"]
    assert (b16.num_patches, b16.hidden_size, b16.num_layers, b16.num_heads, b16.mlp_dim) == (196, 768, 12, 12, 3072)
    assert VIT_CONFIGS["vit-l16"].num_layers == 24 and VIT_CONFIGS["vit-ti16"].num_heads == 3
    with pytest.raises(ValueError):
        ViTConfig(image_size=30, patch_size=4)


def test_output_shapes(model, pixels):
    out = forward(model, pixels, return_tokens=True)
    assert out["logits"].shape == (3, CONFIG.num_classes)
    assert out["cls"].shape == (3, D)
    assert out["tokens"].shape == (3, 1 + CONFIG.num_patches, D)


def test_patch_embedding_is_timm_conv(model, pixels):
    """Our reshape + linear equals a stride-p conv with the exported timm [D, C, p, p] weight."""
    weights = export_timm_state_dict(model)
    nchw = jnp.transpose(pixels, (0, 3, 1, 2))
    conv = jax.lax.conv_general_dilated(
        nchw, weights["patch_embed.proj.weight"], (CONFIG.patch_size,) * 2, "VALID",
        precision=jax.lax.Precision.HIGHEST,
    ) + weights["patch_embed.proj.bias"][None, :, None, None]
    conv = conv.reshape(3, D, -1).transpose(0, 2, 1)  # timm: flatten(2).transpose(1, 2)
    ours = model.patch_embed(patchify(pixels, CONFIG.patch_size))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(conv), atol=1e-5)


@pytest.mark.parametrize("mode, expected_prompt_tokens", [("replace", 4), ("accumulate", 4 * L)])
def test_prompt_token_counts(model, pixels, mode, expected_prompt_tokens):
    out = forward(model, pixels, num_prompts=4, prompts=_prompts(3, 4), prompt_mode=mode, return_tokens=True)
    assert out["tokens"].shape[1] == 1 + CONFIG.num_patches + expected_prompt_tokens
    assert token_counts(CONFIG, (), 4, mode)[-1] == out["tokens"].shape[1]


def test_prompt_modes_differ_and_prompts_matter(model, pixels):
    prompts = _prompts(3, 2)
    replace = forward(model, pixels, num_prompts=2, prompts=prompts, prompt_mode="replace")["logits"]
    accumulate = forward(model, pixels, num_prompts=2, prompts=prompts, prompt_mode="accumulate")["logits"]
    plain = forward(model, pixels)["logits"]
    assert not np.allclose(np.asarray(replace), np.asarray(accumulate), atol=1e-4)
    assert not np.allclose(np.asarray(replace), np.asarray(plain), atol=1e-4)


def test_prompts_shape_is_checked(model, pixels):
    with pytest.raises(ValueError):
        forward(model, pixels, num_prompts=2, prompts=_prompts(3, 3))
    with pytest.raises(ValueError):
        forward(model, pixels, merge_r=(1,))


def test_default_head_equals_explicit_head(model, pixels):
    head_w = jnp.broadcast_to(model.head.kernel[...], (3, D, CONFIG.num_classes))
    head_b = jnp.broadcast_to(model.head.bias[...], (3, CONFIG.num_classes))
    np.testing.assert_allclose(
        np.asarray(forward(model, pixels, head_w=head_w, head_b=head_b)["logits"]),
        np.asarray(forward(model, pixels)["logits"]), atol=1e-6,
    )


@pytest.mark.parametrize("mode, merge_r", [("replace", ()), ("accumulate", ()), ("replace", (3, 2))])
def test_mixed_task_batch_equals_samples_alone(model, pixels, mode, merge_r):
    """One compiled executable, per-sample prompts and heads: each row equals that sample run alone."""
    graphdef, state = nnx.split(model)
    executable = jax.jit(make_vit_fn(graphdef, merge_r=merge_r, num_prompts=2, prompt_mode=mode))
    prompts = _prompts(3, 2)
    head_w = jax.random.normal(jax.random.key(3), (3, D, 5))
    head_b = jax.random.normal(jax.random.key(4), (3, 5))
    batch = executable(state, pixels, prompts, head_w, head_b)["logits"]
    for i in range(3):
        alone = executable(state, pixels[i : i + 1], prompts[i : i + 1], head_w[i : i + 1], head_b[i : i + 1])
        np.testing.assert_allclose(np.asarray(batch[i]), np.asarray(alone["logits"][0]), atol=1e-5)
    assert not np.allclose(np.asarray(batch[0]), np.asarray(batch[1]), atol=1e-3)


def test_weights_are_an_argument_of_the_executable(model, pixels):
    """One AOT-compiled executable serves a different checkpoint: weights are not baked in."""
    graphdef, state = nnx.split(model)
    compiled = jax.jit(make_vit_fn(graphdef)).lower(state, pixels).compile()
    other = init_vit(CONFIG, seed=7)
    np.testing.assert_allclose(
        np.asarray(compiled(nnx.state(other), pixels)["logits"]),
        np.asarray(forward(other, pixels)["logits"]),
        atol=1e-5,
    )


@pytest.mark.parametrize("export", [export_timm_state_dict, export_hf_state_dict])
def test_safetensors_round_trip(model, pixels, tmp_path, export):
    path = str(tmp_path / "model.safetensors")
    save_safetensors(path, export(model))
    loaded = load_vit_safetensors(CONFIG, path)
    np.testing.assert_array_equal(
        np.asarray(forward(loaded, pixels)["logits"]), np.asarray(forward(model, pixels)["logits"])
    )


def test_layout_names_and_shapes(model):
    timm = export_timm_state_dict(model)
    assert timm["patch_embed.proj.weight"].shape == (D, CONFIG.num_channels, CONFIG.patch_size, CONFIG.patch_size)
    assert timm["blocks.1.attn.qkv.weight"].shape == (3 * D, D)
    assert timm["pos_embed"].shape == (1, 1 + CONFIG.num_patches, D)
    assert timm["head.weight"].shape == (CONFIG.num_classes, D)
    hf = export_hf_state_dict(model)
    assert hf["vit.encoder.layer.1.attention.attention.key.weight"].shape == (D, D)
    np.testing.assert_array_equal(hf["vit.encoder.layer.1.attention.attention.key.weight"],
                                  timm["blocks.1.attn.qkv.weight"][D : 2 * D])
    assert hf["vit.embeddings.patch_embeddings.projection.weight"].shape == timm["patch_embed.proj.weight"].shape
    assert "classifier.weight" in hf and "vit.layernorm.bias" in hf


def test_backbone_without_head_and_missing_tensors(model, pixels):
    hf = {k.removeprefix("vit."): v for k, v in export_hf_state_dict(model).items() if not k.startswith("classifier")}
    backbone = load_timm_state_dict(CONFIG, hf)  # bare ViTModel names, no classifier
    out = forward(backbone, pixels)
    np.testing.assert_array_equal(np.asarray(out["logits"]), 0.0)
    np.testing.assert_allclose(np.asarray(out["cls"]), np.asarray(forward(model, pixels)["cls"]), atol=1e-6)
    timm = export_timm_state_dict(model)
    del timm["blocks.0.mlp.fc1.weight"]
    with pytest.raises(KeyError):
        load_timm_state_dict(CONFIG, timm)
    with pytest.raises(ValueError):
        load_timm_state_dict(dataclasses.replace(CONFIG, mlp_dim=128), export_timm_state_dict(model))
