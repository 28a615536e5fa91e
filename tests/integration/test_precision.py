"""Matmul precision: bf16 dense kernels with f32 accumulation, opt-in per servable.

What must hold: float32 stays exactly what it was; bf16 really runs bf16 dots; its keys,
options and pruning never mix with float32's; the real MiniLM keeps its embeddings (cosine
>= 0.9999 to PyTorch's float32 vectors, over HTTP) and the demo ViT its predictions.
"""

from __future__ import annotations

import json
import re

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES
from jaxserve.compile_cache import CompileCache, compile_count
from jaxserve.datasets import digits_examples
from jaxserve.models.bert import BERT_CONFIGS, init_bert
from jaxserve.models.precision import Dense, kernel_dtypes, matmul_weights
from jaxserve.polymorph import PolymorphTable, pad_token_batch
from jaxserve.registry import load_image_runtime
from jaxserve.sched.base import Cell, ShapeGrid
from jaxserve.servables import bert_servable, weights_of
from jaxserve.launch import ServeSettings
from support import LiveServer

TINY = BERT_CONFIGS["bert-tiny-test"]


def test_dense_in_float32_is_nnx_linear():
    rngs = nnx.Rngs(0)
    ours, ref = Dense(48, 24, rngs=nnx.Rngs(0)), nnx.Linear(48, 24, rngs=rngs)
    x = jax.random.normal(jax.random.key(1), (3, 7, 48))
    np.testing.assert_array_equal(np.asarray(ours.kernel[...]), np.asarray(ref.kernel[...]))
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(ref(x)), rtol=0, atol=1e-6)
    assert ours(x).dtype == jnp.float32


def test_matmul_weights_casts_dense_kernels_only():
    model = init_bert(TINY)
    state = nnx.split(model)[1]
    assert matmul_weights(state, "f32") is state
    compiles = compile_count()
    cast = matmul_weights(state, "bf16")
    assert compile_count() == compiles  # cast on the host: loading a model compiles nothing
    before, after = kernel_dtypes(state), kernel_dtypes(cast)
    kernels = {p for p in after if p.endswith("/kernel")}
    assert len(kernels) == 4 * TINY.num_layers
    for path, dtype in after.items():
        assert dtype == (jnp.bfloat16 if path in kernels else before[path]), path
    assert after["word_embeddings/embedding"] == np.float32
    # the abstract state a servable compiles against is cast the same way
    abstract = bert_servable("t", TINY, ShapeGrid((1,), (16,)), "bf16").abstract_state
    assert kernel_dtypes(abstract) == after
    with pytest.raises(ValueError, match="precision must be one of f32, bf16"):
        matmul_weights(state, "fp8")


def test_bf16_cells_run_bf16_dots_with_their_own_keys_and_options():
    grid = ShapeGrid((32,), (128,))  # 4096 rows: float32 turns YNNPACK off, bf16 keeps it for its dots
    f32 = PolymorphTable(bert_servable("t", TINY, grid, "f32"))
    bf16 = PolymorphTable(bert_servable("t", TINY, grid, "bf16"))
    assert not f32.keys() & bf16.keys()
    cell = Cell(32, 128)
    option = "xla_cpu_experimental_ynn_fusion_type"
    assert f32.servable.options_of(cell) == {option: ""}
    assert bf16.servable.options_of(cell) == {option: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    assert bf16.servable.options_of(Cell(8, 128)) == {}  # below 4096 rows: every YNN fusion
    model = init_bert(TINY)
    ids, mask = pad_token_batch([list(range(1000, 1000 + n)) for n in (5, 60, 128)], cell)
    f32.warm_cell(cell)
    bf16.warm_cell(cell)
    a = f32.run(cell, weights_of(model), ids, mask)["embedding"][:3]
    b = bf16.run(cell, weights_of(model, "bf16"), ids, mask)["embedding"][:3]
    assert _bf16_dots(bf16, cell) == 4 * TINY.num_layers  # every dense layer, nothing else
    assert _bf16_dots(f32, cell) == 0
    cos = (a * b).sum(-1)
    assert cos.min() >= 0.999 and np.abs(a - b).max() > 1e-6  # close, and really computed differently
    with pytest.raises(TypeError):  # float32 weights cannot be fed to a bf16 executable
        bf16.run(cell, weights_of(model), ids, mask)


def _bf16_dots(table: PolymorphTable, cell: Cell) -> int:
    """Dots the program asks for with bf16 x bf16 operands and a float32 result."""
    s = table.servable
    text = jax.jit(s.fn_for(cell)).lower(*s.abstract_args(cell)).as_text()
    return len(re.findall(r"dot_general.*\(tensor<[^>]*xbf16>, tensor<[^>]*xbf16>\) -> tensor<[^>]*xf32>", text))


def test_prune_leaves_the_other_precision_alone(tmp_path):
    # without the process-wide XLA cache, which other tests may already hold these programs in
    # (a cell loaded from it is never serialized: see CompileCache)
    cache = CompileCache(tmp_path / "cache", use_xla_cache=False)
    grid = ShapeGrid((1, 2), (16,))
    tables = {p: PolymorphTable(bert_servable("t", TINY, grid, p), cache) for p in ("f32", "bf16")}
    for t in tables.values():
        t.warmup()
    entries = lambda: {p.stem for p in (tmp_path / "cache" / "executables").glob("*.bin")}  # noqa: E731
    assert entries() == tables["f32"].keys() | tables["bf16"].keys()
    # a bf16 deploy whose grid dropped batch 2: only bf16's stale entry goes
    keep = PolymorphTable(bert_servable("t", TINY, ShapeGrid((1,), (16,)), "bf16")).keys()
    assert cache.prune({"t"}, keep, precision="bf16") == 1
    assert entries() == tables["f32"].keys() | keep
    rows = {r["key"]: r for r in json.loads((tmp_path / "cache" / "manifest.json").read_text())["entries"]}
    assert set(rows) == entries() and {r["precision"] for r in rows.values()} == {"f32", "bf16"}


def test_demo_vit_in_bf16_keeps_its_predictions():
    grid = ShapeGrid((16,))
    runtimes = {p: load_image_runtime(grid=grid, precision=p) for p in ("f32", "bf16")}
    rt = runtimes["f32"]
    images, labels = digits_examples(rt.image_shape, count=128, seed=3)
    cell = grid.cells()[0]
    preds, correct = {}, {}
    for p, r in runtimes.items():
        logits = np.concatenate([
            r.table.run(cell, r.weights, *r.prepare_inputs(cell, list(images[i:i + 16]), ["digits"] * 16))["logits"]
            for i in range(0, len(images), 16)])
        preds[p] = logits[:, :10].argmax(-1)
        correct[p] = float((preds[p] == labels).mean())
    assert (preds["f32"] == preds["bf16"]).mean() >= 0.98
    assert correct["bf16"] >= correct["f32"] - 0.02 and correct["f32"] >= 0.9


def test_bf16_server_answers_reference_embeddings(tmp_path):
    """The whole path over HTTP: --precision bf16 warms, answers PyTorch's float32 vectors to
    cosine >= 0.9999, says which precision it serves, and compiles nothing after ready."""
    fx = np.load(FIXTURES / "minilm_parity.npz")
    settings = ServeSettings(models=("minilm-l6",), cache_dir=str(tmp_path / "cache"), progress=False,
                             text_grid=ShapeGrid((1, 4), (16, 64)), precision="bf16")
    with LiveServer(settings) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]
        assert model["precision"] == "bf16"
        picks = [i for i, n in enumerate(fx["lengths"]) if n <= 64][:8]
        r = c.post("/v1/embeddings", json={"model": "minilm-l6", "input": [str(fx["sentences"][i]) for i in picks]})
        assert r.status_code == 200, r.text
        cos = [np.array(d["embedding"]) @ fx["embeddings"][i] for d, i in zip(r.json()["data"], picks)]
        assert min(cos) >= 0.9999 and max(cos) < 0.9999999, cos
        metrics = c.get("/metrics").text
        assert "jaxserve_compilations_since_ready 0.0" in metrics
    written = tmp_path / "cache" / "cost_model-bf16.json"
    assert written.exists() and written.stat().st_mode & 0o777 == 0o600  # a cache file: owner-only
