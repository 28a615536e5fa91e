"""Reading weights out of exported ONNX graphs (torch.onnx exports, float or int8-quantized).

Shared by the converters of checkpoints that come only as ONNX (``dinov2_onnx``, ``bert_onnx``):

* :class:`OnnxGraph`: producer/consumer indices over a graph, initializers and ``Constant`` values as numpy;
* :func:`linear_weights`: every unnamed weight matrix (``onnx::MatMul_1966``) named after the bias
  its product is added to, found by following the graph from the MatMul that reads it to the Add of
  a named bias, never by its position in the file. A float ``MatMul`` (weight stored [in, out]) and
  an onnxruntime dynamic-quantized ``MatMulInteger`` (int8 weight, one scale per output column,
  dequantized here to float32) are both followed;
* :func:`dequantized_gathers`: embedding tables stored quantized (``Gather`` of an integer table,
  then ``DequantizeLinear``), dequantized to float32.

Whatever does not have the expected shape raises ``ValueError`` naming the tensor: a graph that
differs fails loudly rather than converting into a model that silently computes something else.
``onnx`` is needed only at conversion time (serving reads the converted safetensors); onnxruntime
is never used.
"""

from __future__ import annotations

import numpy as np


def require_onnx(what: str, install: str = "pip install onnx"):
    """The ``onnx`` module, or an ImportError saying that converting ``what`` needs it and how to
    install it."""
    try:
        import onnx
    except ImportError as err:  # depends on the environment
        raise ImportError(f"converting {what} needs the onnx package: {install}") from err
    return onnx


class OnnxGraph:
    """Producer/consumer indices over an ONNX graph, constants and initializers as numpy."""

    def __init__(self, model):
        from onnx import helper, numpy_helper

        graph = model.graph
        self.inputs = [i.name for i in graph.input]
        self.initializers = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.nodes = list(graph.node)
        self.producer = {out: n for n in self.nodes for out in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.nodes:
            for name in n.input:
                self.consumers.setdefault(name, []).append(n)
        self.constants = {}
        for n in self.nodes:
            if n.op_type == "Constant":
                for a in n.attribute:
                    if a.name == "value":
                        self.constants[n.output[0]] = numpy_helper.to_array(a.t)
        self.attrs = lambda node: {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def value(self, name: str):
        """The value of an initializer or a ``Constant`` node's output; None for a computed tensor."""
        if name in self.initializers:
            return self.initializers[name]
        return self.constants.get(name)

    def scalar(self, name: str) -> float | None:
        """The value of a one-element constant tensor, else None."""
        v = self.value(name)
        return float(np.asarray(v).ravel()[0]) if v is not None and np.asarray(v).size == 1 else None

    def only_consumer(self, name: str, op_type: str):
        """The single node reading tensor ``name``, which must be an ``op_type``; else ValueError."""
        users = self.consumers.get(name, [])
        if len(users) != 1 or users[0].op_type != op_type:
            raise ValueError(f"{name} is read by {[n.op_type for n in users]}; expected one {op_type}")
        return users[0]

    def upstream_initializers(self, name: str, seen=None) -> set[str]:
        """Initializers reachable by walking producers up from tensor ``name``."""
        seen = set() if seen is None else seen
        if name in seen or not name:
            return set()
        seen.add(name)
        if name in self.initializers:
            return {name}
        node = self.producer.get(name)
        found: set[str] = set()
        for inp in node.input if node is not None else ():
            found |= self.upstream_initializers(inp, seen)
        return found


def _quantized_matmul(g: OnnxGraph, node) -> tuple[np.ndarray, str]:
    """([in, out] float32 weight, the tensor equal to ``x @ weight``) of an onnxruntime dynamic-quantized
    linear layer: ``DynamicQuantizeLinear(x) -> MatMulInteger(xq, Wq, x_zp, W_zp) -> Cast(float) ->
    Mul(x_scale * W_scale)``. Since ``x ~ (xq - x_zp) * x_scale``, that product is ``x @ W`` with
    ``W = (Wq - W_zp) * W_scale`` (one scale per output column, or one for the whole matrix)."""
    xq, wq_name = node.input[0], node.input[1]
    quant = g.producer.get(xq)
    if quant is None or quant.op_type != "DynamicQuantizeLinear" or quant.output[0] != xq:
        raise ValueError(f"{node.name}: its activations are not a DynamicQuantizeLinear's output")
    if len(node.input) < 3 or node.input[2] != quant.output[2]:
        raise ValueError(f"{node.name}: the activation zero point is not its DynamicQuantizeLinear's")
    wq = g.initializers.get(wq_name)
    if wq is None or wq.ndim != 2 or wq.dtype not in (np.int8, np.uint8):
        raise ValueError(f"{node.name}: {wq_name} is not a stored 8-bit [in, out] matrix")
    zp_name = node.input[3] if len(node.input) > 3 else ""
    w_zp = np.zeros((), np.int32) if not zp_name else g.value(zp_name)
    cast = g.only_consumer(node.output[0], "Cast")
    if g.attrs(cast).get("to") != 1:  # TensorProto.FLOAT
        raise ValueError(f"{node.name}: its integer product is cast to {g.attrs(cast).get('to')}, not float32")
    mul = g.only_consumer(cast.output[0], "Mul")
    scales = next((i for i in mul.input if i != cast.output[0]), None)
    scale_mul = g.producer.get(scales)
    if scale_mul is None or scale_mul.op_type != "Mul" or quant.output[1] not in scale_mul.input:
        raise ValueError(f"{node.name}: the product is not rescaled by (activation scale x weight scale)")
    w_scale = g.value(next(i for i in scale_mul.input if i != quant.output[1]))
    if w_zp is None or w_scale is None:
        raise ValueError(f"{node.name}: the weight's zero point or scale is not a stored constant")
    w_scale, w_zp = np.asarray(w_scale, np.float32), np.asarray(w_zp)
    for what, v in (("scale", w_scale), ("zero point", w_zp)):
        if v.size not in (1, wq.shape[1]):
            raise ValueError(f"{node.name}: weight {what} of shape {v.shape} is neither per-tensor nor per-column "
                             f"of {wq.shape}")
    w = (wq.astype(np.int32) - w_zp.astype(np.int32).reshape(1, -1)).astype(np.float32)
    return w * w_scale.reshape(1, -1), mul.output[0]


def linear_weights(g: OnnxGraph, prefix: str = "") -> dict[str, np.ndarray]:
    """HF name -> torch-layout [out, in] float32 weight of every MatMul (or quantized MatMulInteger)
    that multiplies by a stored matrix, named after the named bias (``<prefix>encoder.layer.0.
    attention.self.query.bias`` -> ``encoder.layer.0.attention.self.query.weight``) its product is
    added to. A product that is added to no named bias, or to several, raises ValueError, as does a
    weight that does not fit its bias or two weights mapping to one name. Biases outside ``prefix``
    are not ours (another head of the graph): their weights are left out."""
    out = {}
    for node in g.nodes:
        if node.op_type == "MatMul" and node.input[1] in g.initializers:
            weight_name, w, product = node.input[1], g.initializers[node.input[1]].astype(np.float32), node.output[0]
        elif node.op_type == "MatMulInteger":
            weight_name = node.input[1]
            w, product = _quantized_matmul(g, node)
        else:
            continue
        adds = [c for c in g.consumers.get(product, []) if c.op_type == "Add"]
        biases = [i for a in adds for i in a.input if i.endswith(".bias") and i in g.initializers]
        if len(biases) != 1:
            raise ValueError(f"{weight_name}: its {node.op_type} feeds {len(biases)} named biases ({biases}); "
                             "expected one")
        bias = biases[0]
        if not bias.startswith(prefix):
            continue
        hf = bias.removeprefix(prefix).removesuffix(".bias") + ".weight"
        if w.ndim != 2 or w.shape[1] != g.initializers[bias].shape[0]:
            raise ValueError(f"{weight_name} {w.shape} does not fit {bias} {g.initializers[bias].shape}")
        if hf in out:
            raise ValueError(f"two MatMul weights map to {hf}")
        out[hf] = np.ascontiguousarray(w.T)  # ONNX [in, out] -> torch nn.Linear [out, in]
    return out


def dequantized_gathers(g: OnnxGraph) -> dict[str, np.ndarray]:
    """Initializer name (``..._quantized`` suffix dropped) -> float32 table, for every stored integer
    table that a ``Gather`` reads and a ``DequantizeLinear`` with a per-tensor scale and zero point
    turns back into floats: ``(q - zero_point) * scale``, as onnxruntime computes it after the
    Gather (dequantizing the table first gives the same rows exactly)."""
    out = {}
    for node in g.nodes:
        table = g.initializers.get(node.input[0]) if node.op_type == "Gather" else None
        if table is None or table.dtype.kind not in "iu":
            continue
        if g.attrs(node).get("axis", 0) != 0:
            raise ValueError(f"{node.name}: gathers along axis {g.attrs(node)['axis']}, not rows")
        deq = g.only_consumer(node.output[0], "DequantizeLinear")
        scale, zp = g.value(deq.input[1]), g.value(deq.input[2]) if len(deq.input) > 2 else np.zeros(())
        if scale is None or zp is None or np.asarray(scale).size != 1 or np.asarray(zp).size != 1:
            raise ValueError(f"{node.name}: {node.input[0]} has no stored per-tensor scale and zero point")
        name = node.input[0].removesuffix("_quantized")
        if name in out:
            raise ValueError(f"two quantized tables map to {name}")
        out[name] = ((table.astype(np.int32) - int(np.asarray(zp).ravel()[0])).astype(np.float32)
                     * np.float32(np.asarray(scale).ravel()[0]))
    return out
