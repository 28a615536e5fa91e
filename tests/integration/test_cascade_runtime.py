"""Tabi's importance vector comes out of the small model's own executable, and a cascade level's
runtime turns it into the next level's pruned input (real MiniLM-L3 weights)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.cascade import CascadeText, tokenizer_for
from jaxserve.models.bert import make_encode_fn
from jaxserve.polymorph import pad_token_batch
from jaxserve.registry import load_text_model, load_text_runtime
from jaxserve.sched.base import Cell, ShapeGrid

TEXTS = ["This paper is beautifully written and enjoyable to read!",
         "the movie was a total waste of time, and the acting was wooden"]


@pytest.fixture(scope="module")
def l3():
    cfg, model, tokenizer_json = load_text_model("minilm-l3")
    graphdef, state = nnx.split(model)
    return cfg, graphdef, state, tokenizer_for("minilm-l3")


def test_the_importance_output_leaves_the_prediction_alone_and_is_a_sum_of_attention(l3):
    cfg, graphdef, state, tok = l3
    plain = jax.jit(make_encode_fn(graphdef))
    with_importance = jax.jit(make_encode_fn(graphdef, importance=True))
    ids = tok.encode(TEXTS)
    x, mask = pad_token_batch(ids, Cell(2, 32), pad_id=tok.pad_id)
    a, b = plain(state, x, mask), with_importance(state, x, mask)
    assert np.abs(np.asarray(a["embedding"]) - np.asarray(b["embedding"])).max() < 1e-5
    imp = np.asarray(b["_importance"])
    for row, seq in enumerate(ids):
        n = len(seq)
        # each real query spreads probability 1 over the keys, in every layer and head
        assert imp[row].sum() == pytest.approx(cfg.num_layers * cfg.num_heads * n, rel=1e-5)
        assert (imp[row, n:] == 0).all() and (imp[row, :n] > 0).all()
    # the bucket a text is padded to does not change its importance
    x16, m16 = pad_token_batch(ids[:1], Cell(1, 16), pad_id=tok.pad_id)
    alone = np.asarray(with_importance(state, x16, m16)["_importance"])[0, :len(ids[0])]
    assert np.allclose(alone, imp[0, :len(ids[0])], rtol=1e-4, atol=1e-4)


def test_a_cascade_level_runtime_prunes_the_next_input_from_its_executable(tmp_path):
    grid = ShapeGrid(batch_sizes=(2,), seq_buckets=(32,))
    rt = load_text_runtime("minilm-l3", cache=None, grid=grid, importance=True, tune=False,
                           heads_dir=tmp_path)  # no heads: embeddings only
    assert "-importance" in rt.table.servable.config_hash
    assert tokenizer_for("minilm-l3") is rt.tokenizer  # registered: never loaded while a request waits
    tok = rt.tokenizer
    payloads = [CascadeText(t, tuple(tok.encode([t])[0]), 1.0, ("minilm-l6",), (64,)) for t in TEXTS]
    out = rt.execute(Cell(2, 32), payloads, ["", ""])
    for item, p in zip(out.items, payloads):
        nxt = item["_next"]["minilm-l6"]
        assert 0 < len(nxt.ids) < len(p.ids)  # alpha 1.0 prunes the below-average words
        assert item["pruned_tokens"] == len(tokenizer_for("minilm-l6").encode([p.text])[0]) - len(nxt.ids)
        assert nxt.alpha is None and nxt.next_models == ()
        words = set(nxt.text.split())
        assert words <= set(p.text.replace(",", " ,").replace("!", " !").split()) | {",", "!"}
    # plain token ids still run as before, with no cascade outputs
    plain = rt.execute(Cell(2, 32), [list(p.ids) for p in payloads], ["", ""])
    assert "_next" not in plain.items[0]
    assert np.allclose(plain.items[0]["embedding"], out.items[0]["embedding"], atol=1e-5)
