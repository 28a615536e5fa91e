"""BERT encoder in Flax NNX, and import of HF-format checkpoints.

One flat file (big_vision style): config as data, the module, the pure forward the
polymorph table compiles, and the checkpoint import. The weights are always an
*argument* of the compiled function (``nnx.split`` state), never a baked constant,
so one executable serves every checkpoint of a config.

Numerics follow HF ``BertModel`` exactly where it matters for parity: post-LN
layers, exact-erf GELU, LayerNorm eps from the config, additive ``-inf``-like mask
on padded keys. Mean pooling is over real tokens only, then L2-normalised, which is
what sentence-transformers' all-MiniLM-L6-v2 does.

The same code serves MPNet (``BertConfig.family == "mpnet"``, HF ``MPNetModel``): the
same post-LN layers, plus a relative-position attention bias [H, S, S] computed once per
forward from a [buckets, H] table shared by all layers (:func:`relative_position_buckets`),
no token-type embeddings, and position ids counting from ``pad_token_id + 1`` over the real
tokens. Every BERT-family program is exactly what it was before MPNet existed.
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

from jaxserve.models.attention import qkv_attention, record_importance
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
    # "bert" (HF BertModel) or "mpnet" (HF MPNetModel: relative-position bias, no token types
    # (type_vocab_size 0), positions from pad_token_id + 1).
    family: str = "bert"
    relative_attention_num_buckets: int = 0  # MPNet: 32
    relative_attention_max_distance: int = 128  # MPNet's, fixed in HF's code

    def __post_init__(self):
        if self.family not in ("bert", "mpnet"):
            raise ValueError(f"unknown model family {self.family!r}; 'bert' or 'mpnet'")
        if self.family == "mpnet" and (self.relative_attention_num_buckets < 2 or self.type_vocab_size != 0):
            raise ValueError("an mpnet config needs relative_attention_num_buckets >= 2 and type_vocab_size 0")
        if self.family == "bert" and self.relative_attention_num_buckets:
            raise ValueError("a bert config has no relative attention buckets")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_offset(self) -> int:
        """The position id of the first token: 0 for BERT; ``pad_token_id + 1`` for MPNet (HF's
        ``create_position_ids_from_input_ids``)."""
        return self.pad_token_id + 1 if self.family == "mpnet" else 0

    @property
    def max_length(self) -> int:
        """The longest sequence the position embeddings cover (MPNet: 514 rows, from 2: 512)."""
        return self.max_position - self.position_offset

    def key(self) -> str:
        """A stable hash of the architecture: the compile cache keys executables by it.
        The fields MPNet added are hashed only where they differ from their defaults, so
        every BERT config keeps the key it had before them."""
        fields = dataclasses.asdict(self)
        for f in ("family", "relative_attention_num_buckets", "relative_attention_max_distance"):
            if fields[f] == BertConfig.__dataclass_fields__[f].default:
                del fields[f]
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_hf(self) -> dict:
        """The HF config.json of this model (``BertModel`` or ``MPNetModel``): the fields
        :meth:`from_hf` reads back into an equal config."""
        hf = {"hidden_act": "gelu", "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
              "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
              "intermediate_size": self.intermediate_size, "max_position_embeddings": self.max_position,
              "layer_norm_eps": self.layer_norm_eps, "pad_token_id": self.pad_token_id}
        if self.family == "mpnet":
            return {"architectures": ["MPNetModel"], "model_type": "mpnet", **hf,
                    "relative_attention_num_buckets": self.relative_attention_num_buckets}
        return {"architectures": ["BertModel"], "model_type": "bert", **hf, "type_vocab_size": self.type_vocab_size,
                "position_embedding_type": "absolute"}

    @classmethod
    def from_hf(cls, config: dict) -> "BertConfig":
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}; only exact 'gelu'")
        shape = dict(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                     num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
                     intermediate_size=config["intermediate_size"], max_position=config["max_position_embeddings"],
                     layer_norm_eps=config.get("layer_norm_eps", 1e-12))
        if config.get("model_type") == "mpnet":
            if config.get("relative_attention_num_buckets", 32) != 32:
                # HF's MPNetEncoder.compute_position_bias buckets into 32 whatever the config says
                raise ValueError("only 32 relative attention buckets are supported (as HF computes them)")
            return cls(**shape, type_vocab_size=0, pad_token_id=config.get("pad_token_id", 1), family="mpnet",
                       relative_attention_num_buckets=config.get("relative_attention_num_buckets", 32))
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        return cls(**shape, type_vocab_size=config.get("type_vocab_size", 2), pad_token_id=config.get("pad_token_id", 0))


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

    def __call__(self, x: jax.Array, key_bias: jax.Array, pos_bias: jax.Array | None = None) -> jax.Array:
        """``key_bias`` [B, S] per key (padding); ``pos_bias`` [H, S, S] (query, key) or None
        (MPNet's relative-position bias, shared by the batch and by every layer)."""
        b, s, d = x.shape
        h = self.num_heads
        dh = d // h
        qkv = self.qkv(x).reshape(b, s, 3, h, dh)
        # layout, the fused CPU kernel and the choices behind them: jaxserve.models.attention
        ctx = qkv_attention(qkv, key_bias, float(1.0 / np.sqrt(dh)), pos_bias)
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


def _init_embeddings(module: nnx.Module, cfg: BertConfig, rngs: nnx.Rngs) -> None:
    d = cfg.hidden_size
    module.word_embeddings = nnx.Embed(cfg.vocab_size, d, rngs=rngs)
    module.position_embeddings = nnx.Embed(cfg.max_position, d, rngs=rngs)
    if cfg.family == "bert":  # MPNet has no token types
        module.token_type_embeddings = nnx.Embed(cfg.type_vocab_size, d, rngs=rngs)
    module.embed_norm = nnx.LayerNorm(d, epsilon=cfg.layer_norm_eps, rngs=rngs)


class Bert(nnx.Module):
    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        _init_embeddings(self, cfg, rngs)
        if cfg.family == "mpnet":  # [buckets, H], HF's encoder.relative_attention_bias
            self.relative_attention_bias = nnx.Embed(cfg.relative_attention_num_buckets, cfg.num_heads, rngs=rngs)
        self.layers = nnx.List([BertLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, token_type_ids: jax.Array | None = None):
        """Last hidden states [B, S, D] for int32 ids and a {0,1} mask of real tokens (MPNet
        takes no ``token_type_ids``)."""
        x = embed_tokens(self, input_ids, token_type_ids, attention_mask)
        key_bias = padding_bias(attention_mask, x.dtype)
        pos_bias = position_bias(self, input_ids.shape[1])
        for layer in self.layers:
            x = layer(x, key_bias, pos_bias)
        return x


def embed_tokens(model: nnx.Module, input_ids: jax.Array, token_type_ids: jax.Array | None = None,
                 attention_mask: jax.Array | None = None) -> jax.Array:
    """The embedding sum and its LayerNorm, [B, S, D], of a module holding BERT's embeddings
    (a :class:`Bert`, or the first :class:`BertStage`).

    BERT: word + position (0..S-1) + token type. MPNet: word + position, where a real token's
    position is ``pad_token_id`` + its rank among the real tokens (1-based) and a padded one's
    is ``pad_token_id``, as HF's ``create_position_ids_from_input_ids`` gives for ids whose
    padding is exactly the masked tokens (here read from ``attention_mask``, so padding ids
    need not be the pad token); without a mask every token is real."""
    cfg = model.cfg
    s = input_ids.shape[1]
    if cfg.family == "mpnet":
        if token_type_ids is not None:
            raise ValueError("MPNet has no token type embeddings")
        real = (jnp.ones_like(input_ids) if attention_mask is None else (attention_mask > 0)).astype(jnp.int32)
        positions = jnp.cumsum(real, axis=1) * real + cfg.pad_token_id
        return model.embed_norm(model.word_embeddings(input_ids) + model.position_embeddings(positions))
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    x = (
        model.word_embeddings(input_ids)
        + model.position_embeddings(jnp.arange(s)[None, :])
        + model.token_type_embeddings(token_type_ids)
    )
    return model.embed_norm(x)


def relative_position_buckets(seq_len: int, num_buckets: int = 32, max_distance: int = 128) -> np.ndarray:
    """int32 [S, S]: the bucket of key j seen from query i, HF MPNet's (T5-style, bidirectional)
    ``relative_position_bucket`` of ``j - i``: half the buckets per direction (keys before the
    query from ``num_buckets // 2``), exact below a quarter of ``num_buckets``, logarithmic up
    to ``max_distance``, the last bucket beyond. Computed in float32 as torch computes it, so
    distances on a bucket boundary (16, 32, 64) fall where HF's do. Static: ``seq_len`` is a
    shape, so this is a constant of each executable, not a traced op."""
    pos = np.arange(seq_len, dtype=np.int64)
    n = -(pos[None, :] - pos[:, None])  # query - key
    half = num_buckets // 2
    ret = (n < 0).astype(np.int64) * half
    n = np.abs(n)
    max_exact = half // 2
    # n < max_exact takes the exact branch; 1 stands in there so the log stays finite
    ratio = (np.log(np.maximum(n, 1).astype(np.float32) / np.float32(max_exact))
             / np.float32(np.log(max_distance / max_exact)))
    large = max_exact + (ratio * np.float32(half - max_exact)).astype(np.int64)
    large = np.minimum(large, half - 1)
    return (ret + np.where(n < max_exact, n, large)).astype(np.int32)


def position_bias(model: nnx.Module, seq_len: int) -> jax.Array | None:
    """MPNet's relative-position attention bias [H, S(query), S(key)] from the module's
    [buckets, H] table (a :class:`Bert` or any :class:`BertStage`: each holds the table);
    None for BERT. It depends on positions only, not on padding: a sequence padded into a
    longer bucket sees, among its real tokens, exactly the bias it sees unpadded."""
    cfg = model.cfg
    if cfg.family != "mpnet":
        return None
    buckets = relative_position_buckets(seq_len, cfg.relative_attention_num_buckets,
                                        cfg.relative_attention_max_distance)
    table = model.relative_attention_bias.embedding[...]  # [buckets, H]
    return jnp.transpose(jnp.take(table, jnp.asarray(buckets), axis=0), (2, 0, 1))


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
    the last stage's function pools (:func:`make_bert_stage_fn`).

    An MPNet stage (every one, first or not) also holds the [buckets, H] relative-position
    table, the whole model's ``relative_attention_bias`` (sliced to each stage by path, 1.5 KB
    for MPNet-base), and computes the bias from it: nothing but the hidden states and the mask
    travels between stages, and chained stages give the whole model's numbers."""

    def __init__(self, cfg: BertConfig, start: int, stop: int, *, rngs: nnx.Rngs):
        if not 0 <= start < stop <= cfg.num_layers:
            raise ValueError(f"[{start}:{stop}] is not a layer range of a {cfg.num_layers}-layer BERT")
        self.cfg = cfg
        self.start, self.stop = start, stop
        if start == 0:
            _init_embeddings(self, cfg, rngs)
        if cfg.family == "mpnet":
            self.relative_attention_bias = nnx.Embed(cfg.relative_attention_num_buckets, cfg.num_heads, rngs=rngs)
        self.layers = nnx.List([BertLayer(cfg, rngs=rngs) for _ in range(stop - start)])

    def __call__(self, x: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """Hidden states [B, S, D] after layer ``stop - 1``, from int32 ids [B, S] (first
        stage) or the hidden states after layer ``start - 1``."""
        if self.start == 0:
            x = embed_tokens(self, x, None, attention_mask)
        key_bias = padding_bias(attention_mask, x.dtype)
        pos_bias = position_bias(self, attention_mask.shape[1])
        for layer in self.layers:
            x = layer(x, key_bias, pos_bias)
        return x


def pool(hidden: jax.Array, attention_mask: jax.Array) -> dict[str, jax.Array]:
    """Sentence vectors: L2-normalised mean over real tokens, and the CLS state."""
    m = attention_mask.astype(hidden.dtype)[..., None]
    mean = (hidden * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1e-9)
    norm = jnp.sqrt((mean * mean).sum(axis=-1, keepdims=True))
    return {"embedding": mean / jnp.maximum(norm, 1e-12), "cls": hidden[:, 0]}


def make_encode_fn(graphdef: nnx.GraphDef, importance: bool = False):
    """The pure function every BERT polymorph compiles: (weights, ids, mask) -> pooled. With
    ``importance`` it also returns ``_importance`` [B, S]: per token, the attention probability
    it receives summed over layers, heads and real query rows (Tabi's Eq. 5 vector; 0 on
    padding), from the same forward pass (``jaxserve.models.attention.record_importance``)."""

    def encode(state, input_ids, attention_mask):
        model = nnx.merge(graphdef, state)
        if not importance:
            return pool(model(input_ids, attention_mask), attention_mask)
        with record_importance(attention_mask) as layers:
            hidden = model(input_ids, attention_mask)
        out = pool(hidden, attention_mask)
        out["_importance"] = sum(layers) * attention_mask.astype(hidden.dtype)
        return out

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
    if cfg.family == "mpnet":
        return _hf_mpnet_name_map(cfg)
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


def _hf_mpnet_name_map(cfg: BertConfig) -> dict[str, tuple[str, ...]]:
    """As :func:`_hf_name_map`, for HF ``MPNetModel``'s names (its pooler is not used)."""
    m: dict[str, tuple[str, ...]] = {
        "word_embeddings/embedding": ("embeddings.word_embeddings.weight",),
        "position_embeddings/embedding": ("embeddings.position_embeddings.weight",),
        "embed_norm/scale": ("embeddings.LayerNorm.weight",),
        "embed_norm/bias": ("embeddings.LayerNorm.bias",),
        "relative_attention_bias/embedding": ("encoder.relative_attention_bias.weight",),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        a = p + "attention.attn."
        m[f"layers/{i}/qkv/kernel"] = tuple(a + n + ".weight" for n in "qkv")
        m[f"layers/{i}/qkv/bias"] = tuple(a + n + ".bias" for n in "qkv")
        m[f"layers/{i}/attn_out/kernel"] = (a + "o.weight",)
        m[f"layers/{i}/attn_out/bias"] = (a + "o.bias",)
        m[f"layers/{i}/attn_norm/scale"] = (p + "attention.LayerNorm.weight",)
        m[f"layers/{i}/attn_norm/bias"] = (p + "attention.LayerNorm.bias",)
        m[f"layers/{i}/mlp_in/kernel"] = (p + "intermediate.dense.weight",)
        m[f"layers/{i}/mlp_in/bias"] = (p + "intermediate.dense.bias",)
        m[f"layers/{i}/mlp_out/kernel"] = (p + "output.dense.weight",)
        m[f"layers/{i}/mlp_out/bias"] = (p + "output.dense.bias",)
        m[f"layers/{i}/mlp_norm/scale"] = (p + "output.LayerNorm.weight",)
        m[f"layers/{i}/mlp_norm/bias"] = (p + "output.LayerNorm.bias",)
    return m


def _hf_tensor(tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
    for candidate in (name, "bert." + name, "mpnet." + name):
        if candidate in tensors:
            return tensors[candidate]
    raise KeyError(f"checkpoint has no tensor {name!r}")


def load_hf_bert(model_dir: str | Path) -> tuple[BertConfig, Bert]:
    """Load an HF-format BERT (or MPNet: ``model_type`` "mpnet") checkpoint directory
    (config.json + model.safetensors).

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
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
