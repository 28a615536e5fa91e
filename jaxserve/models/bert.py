"""BERT encoder in Flax NNX, and import of HF-format checkpoints.

One flat file (big_vision style): config as data, the module, the pure forward the
polymorph table compiles, and the checkpoint import. The weights are always an
*argument* of the compiled function (``nnx.split`` state), never a baked constant,
so one executable serves every checkpoint of a config.

Numerics follow HF ``BertModel`` exactly where it matters for parity: post-LN
layers, exact-erf GELU, LayerNorm eps from the config, additive ``-inf``-like mask
on padded keys. Mean pooling is over real tokens only, then L2-normalised, which is
what sentence-transformers' all-MiniLM-L6-v2 does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.attention import qkv_attention
from jaxserve.models.precision import Dense


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def key(self) -> str:
        """A stable hash of the architecture: the compile cache keys executables by it."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_hf(cls, config: dict) -> "BertConfig":
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}; only exact 'gelu'")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_position=config["max_position_embeddings"],
            type_vocab_size=config.get("type_vocab_size", 2),
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            pad_token_id=config.get("pad_token_id", 0),
        )


BERT_CONFIGS: dict[str, BertConfig] = {
    "minilm-l6": BertConfig(hidden_size=384, num_layers=6, num_heads=12, intermediate_size=1536),
    "bert-base": BertConfig(),
    "bert-large": BertConfig(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096),
    "bert-tiny-test": BertConfig(
        vocab_size=30522, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=512
    ),
}


class BertLayer(nnx.Module):
    """Post-LN encoder layer: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        # One fused QKV projection: a single [d, 3d] matmul keeps the CPU's GEMM busy
        # instead of three thin ones (measured in bench/peer.py). Dense: nnx.Linear whose
        # dot runs in the kernel's dtype (jaxserve.models.precision).
        self.qkv = Dense(d, 3 * d, rngs=rngs)
        self.attn_out = Dense(d, d, rngs=rngs)
        self.attn_norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.mlp_in = Dense(d, cfg.intermediate_size, rngs=rngs)
        self.mlp_out = Dense(cfg.intermediate_size, d, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)

    def __call__(self, x: jax.Array, key_bias: jax.Array) -> jax.Array:
        b, s, d = x.shape
        h = self.num_heads
        dh = d // h
        qkv = self.qkv(x).reshape(b, s, 3, h, dh)
        # layout, the fused CPU kernel and the choices behind them: jaxserve.models.attention
        ctx = qkv_attention(qkv, key_bias, float(1.0 / np.sqrt(dh)))
        x = self.attn_norm(x + self.attn_out(ctx.reshape(b, s, d)))
        y = self.mlp_out(gelu_exact(self.mlp_in(x)))
        return self.mlp_norm(x + y)


def gelu_exact(x: jax.Array) -> jax.Array:
    """GELU with the exact erf, written as HF/torch write it: x/2 * (1 + erf(x/sqrt 2)).

    ``jax.nn.gelu(approximate=False)`` goes through ``erfc``, which XLA expands into three
    branches (two rational approximations, an exp and two divides) all evaluated per
    element: several times slower than this form on the CPU, for no accuracy the parity test
    sees (measurements: bench/RESULTS.md, 'The measurements behind the code's rules').
    """
    return 0.5 * x * (1.0 + jax.lax.erf(x * np.float32(1.0 / np.sqrt(2.0))))


class Bert(nnx.Module):
    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.hidden_size
        self.word_embeddings = nnx.Embed(cfg.vocab_size, d, rngs=rngs)
        self.position_embeddings = nnx.Embed(cfg.max_position, d, rngs=rngs)
        self.token_type_embeddings = nnx.Embed(cfg.type_vocab_size, d, rngs=rngs)
        self.embed_norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.layers = nnx.List([BertLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, token_type_ids: jax.Array | None = None):
        """Last hidden states [B, S, D] for int32 ids and a {0,1} mask of real tokens."""
        x = embed_tokens(self, input_ids, token_type_ids)
        key_bias = padding_bias(attention_mask, x.dtype)
        for layer in self.layers:
            x = layer(x, key_bias)
        return x


def embed_tokens(model: nnx.Module, input_ids: jax.Array, token_type_ids: jax.Array | None = None) -> jax.Array:
    """The embedding sum and its LayerNorm, [B, S, D], of a module holding BERT's embeddings
    (a :class:`Bert`, or the first :class:`BertStage`)."""
    s = input_ids.shape[1]
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    x = (
        model.word_embeddings(input_ids)
        + model.position_embeddings(jnp.arange(s)[None, :])
        + model.token_type_embeddings(token_type_ids)
    )
    return model.embed_norm(x)


def padding_bias(attention_mask: jax.Array, dtype) -> jax.Array:
    """The additive attention bias of each key [B, S]: 0 for real tokens, -1e9 for padding.
    Finite (not -inf) so an all-padding row (a padded batch slot) stays NaN-free."""
    return jnp.where(attention_mask > 0, 0.0, -1e9).astype(dtype)


class BertStage(nnx.Module):
    """Layers [start, stop) of a ``cfg.num_layers``-deep :class:`Bert` (a pipeline stage).

    The first stage (start 0) also holds the embeddings and takes token ids; a later one
    takes the hidden states [B, S, D] its predecessor returned. Parameter names are
    Bert's, with the layers renumbered from 0, so a stage's weights are a slice of a Bert's
    state by path (``jaxserve.stages.slice_stage_weights``). Pooling has no parameters:
    the last stage's function pools (:func:`make_bert_stage_fn`)."""

    def __init__(self, cfg: BertConfig, start: int, stop: int, *, rngs: nnx.Rngs):
        if not 0 <= start < stop <= cfg.num_layers:
            raise ValueError(f"[{start}:{stop}] is not a layer range of a {cfg.num_layers}-layer BERT")
        self.cfg = cfg
        self.start, self.stop = start, stop
        if start == 0:
            d = cfg.hidden_size
            self.word_embeddings = nnx.Embed(cfg.vocab_size, d, rngs=rngs)
            self.position_embeddings = nnx.Embed(cfg.max_position, d, rngs=rngs)
            self.token_type_embeddings = nnx.Embed(cfg.type_vocab_size, d, rngs=rngs)
            self.embed_norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)
        self.layers = nnx.List([BertLayer(cfg, rngs=rngs) for _ in range(stop - start)])

    def __call__(self, x: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """Hidden states [B, S, D] after layer ``stop - 1``, from int32 ids [B, S] (first
        stage) or the hidden states after layer ``start - 1``."""
        if self.start == 0:
            x = embed_tokens(self, x)
        key_bias = padding_bias(attention_mask, x.dtype)
        for layer in self.layers:
            x = layer(x, key_bias)
        return x


def pool(hidden: jax.Array, attention_mask: jax.Array) -> dict[str, jax.Array]:
    """Sentence vectors: L2-normalised mean over real tokens, and the CLS state."""
    m = attention_mask.astype(hidden.dtype)[..., None]
    mean = (hidden * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1e-9)
    norm = jnp.sqrt((mean * mean).sum(axis=-1, keepdims=True))
    return {"embedding": mean / jnp.maximum(norm, 1e-12), "cls": hidden[:, 0]}


def make_encode_fn(graphdef: nnx.GraphDef):
    """The pure function every BERT polymorph compiles: (weights, ids, mask) -> pooled."""

    def encode(state, input_ids, attention_mask):
        model = nnx.merge(graphdef, state)
        return pool(model(input_ids, attention_mask), attention_mask)

    return encode


def make_bert_stage_fn(graphdef: nnx.GraphDef, last: bool):
    """The pure function a BERT stage's polymorph compiles: (weights, ids or hidden, mask) ->
    the pooled ``{'embedding', 'cls'}`` (``last``) or ``{'hidden': [B, S, D]}``."""

    def stage(state, x, attention_mask):
        hidden = nnx.merge(graphdef, state)(x, attention_mask)
        return pool(hidden, attention_mask) if last else {"hidden": hidden}

    return stage


def abstract_bert_stage(cfg: BertConfig, start: int, stop: int):
    """(graphdef, abstract state) of :class:`BertStage` ``[start, stop)``, allocating nothing."""
    return nnx.split(nnx.eval_shape(lambda: BertStage(cfg, start, stop, rngs=nnx.Rngs(0))))


def init_bert(cfg: BertConfig, seed: int = 0) -> Bert:
    return Bert(cfg, rngs=nnx.Rngs(seed))


def abstract_bert(cfg: BertConfig):
    """(graphdef, abstract state) without allocating weights: what warmup compiles against."""
    model = nnx.eval_shape(lambda: Bert(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model)


# --------------------------------------------------------------------------- import

def _hf_name_map(cfg: BertConfig) -> dict[str, tuple[str, ...]]:
    """Our parameter path -> HF tensor name(s). Several names are concatenated (fused QKV)."""
    m: dict[str, tuple[str, ...]] = {
        "word_embeddings/embedding": ("embeddings.word_embeddings.weight",),
        "position_embeddings/embedding": ("embeddings.position_embeddings.weight",),
        "token_type_embeddings/embedding": ("embeddings.token_type_embeddings.weight",),
        "embed_norm/scale": ("embeddings.LayerNorm.weight",),
        "embed_norm/bias": ("embeddings.LayerNorm.bias",),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        a = p + "attention.self."
        m[f"layers/{i}/qkv/kernel"] = tuple(a + n + ".weight" for n in ("query", "key", "value"))
        m[f"layers/{i}/qkv/bias"] = tuple(a + n + ".bias" for n in ("query", "key", "value"))
        m[f"layers/{i}/attn_out/kernel"] = (p + "attention.output.dense.weight",)
        m[f"layers/{i}/attn_out/bias"] = (p + "attention.output.dense.bias",)
        m[f"layers/{i}/attn_norm/scale"] = (p + "attention.output.LayerNorm.weight",)
        m[f"layers/{i}/attn_norm/bias"] = (p + "attention.output.LayerNorm.bias",)
        m[f"layers/{i}/mlp_in/kernel"] = (p + "intermediate.dense.weight",)
        m[f"layers/{i}/mlp_in/bias"] = (p + "intermediate.dense.bias",)
        m[f"layers/{i}/mlp_out/kernel"] = (p + "output.dense.weight",)
        m[f"layers/{i}/mlp_out/bias"] = (p + "output.dense.bias",)
        m[f"layers/{i}/mlp_norm/scale"] = (p + "output.LayerNorm.weight",)
        m[f"layers/{i}/mlp_norm/bias"] = (p + "output.LayerNorm.bias",)
    return m


def _hf_tensor(tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
    for candidate in (name, "bert." + name):
        if candidate in tensors:
            return tensors[candidate]
    raise KeyError(f"checkpoint has no tensor {name!r}")


def load_hf_bert(model_dir: str | Path) -> tuple[BertConfig, Bert]:
    """Load an HF-format BERT checkpoint directory (config.json + model.safetensors).

    Linear weights are transposed from torch's [out, in] to our [in, out]; Q, K and V
    are concatenated into the fused projection. Missing or mis-shaped tensors raise.
    """
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    cfg = BertConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    tensors = load_file(str(model_dir / "model.safetensors"))
    graphdef, abstract = abstract_bert(cfg)  # no random init: every weight comes from the file
    shapes = {"/".join(str(k) for k in path): tuple(v.shape) for path, v in nnx.to_flat_state(abstract)}
    values = {}
    for ours, names in _hf_name_map(cfg).items():
        parts = [_hf_tensor(tensors, n) for n in names]
        if ours.endswith("/kernel"):
            parts = [p.T for p in parts]
        value = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        if shapes[ours] != value.shape:
            raise ValueError(f"{ours}: checkpoint shape {value.shape} != model shape {shapes[ours]}")
        values[ours] = jnp.asarray(value, dtype=jnp.float32)
    missing = set(shapes) - set(values)
    if missing:
        raise ValueError(f"no checkpoint mapping for {sorted(missing)}")
    state = nnx.from_flat_state(
        [(path, v.replace(values["/".join(str(k) for k in path)])) for path, v in nnx.to_flat_state(abstract)]
    )
    return cfg, nnx.merge(graphdef, state)


def export_hf_bert(model: Bert, out_dir: str | Path) -> None:
    """Write ``model`` as an HF-format checkpoint (the inverse of :func:`load_hf_bert`)."""
    from safetensors.numpy import save_file

    cfg = model.cfg
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _, state = nnx.split(model)
    flat = {"/".join(str(k) for k in path): np.asarray(leaf.get_value()) for path, leaf in nnx.to_flat_state(state)}
    tensors: dict[str, np.ndarray] = {}
    for ours, names in _hf_name_map(cfg).items():
        value = flat[ours]
        parts = np.split(value, len(names), axis=-1) if len(names) > 1 else [value]
        for name, part in zip(names, parts):
            tensors[name] = np.ascontiguousarray(part.T if ours.endswith("/kernel") else part)
    save_file(tensors, str(out_dir / "model.safetensors"))
    hf = {
        "architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.intermediate_size, "max_position_embeddings": cfg.max_position,
        "type_vocab_size": cfg.type_vocab_size, "layer_norm_eps": cfg.layer_norm_eps,
        "pad_token_id": cfg.pad_token_id, "position_embedding_type": "absolute",
    }
    (out_dir / "config.json").write_text(json.dumps(hf, indent=1))
