"""BERT numerics: parity with HF transformers (committed fixture) and checkpoint round trip."""

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import FIXTURES
from jaxserve.models.bert import BERT_CONFIGS, export_hf_bert, init_bert, load_hf_bert, pool
from jaxserve.models.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def fixture():
    return np.load(FIXTURES / "minilm_parity.npz")


def _split(flat, lengths):
    return np.split(flat, np.cumsum(lengths)[:-1])


def test_tokenizer_matches_reference_ids(minilm_dir, fixture):
    tok = TextTokenizer(minilm_dir / "tokenizer.json")
    ours = tok.encode(list(fixture["sentences"]))
    ref = _split(fixture["input_ids"], fixture["lengths"])
    assert len(ours) == len(ref) >= 16
    for a, b in zip(ours, ref):
        assert a == list(b)


def test_minilm_parity_with_hf_transformers(minilm, fixture):
    """Hidden states within 1e-4 and sentence embeddings cosine >= 0.99999 vs PyTorch."""
    _, model = minilm
    lengths = fixture["lengths"]
    ids = _split(fixture["input_ids"], lengths)
    types = _split(fixture["token_type_ids"], lengths)
    hidden_ref = _split(fixture["hidden"], lengths)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, x, m, t: nnx.merge(graphdef, s)(x, m, t))
    worst = 0.0
    for i, (x, t) in enumerate(zip(ids, types)):
        mask = np.ones((1, len(x)), np.int32)
        h = forward(state, x[None].astype(np.int32), mask, t[None].astype(np.int32))
        worst = max(worst, float(np.abs(np.asarray(h[0]) - hidden_ref[i]).max()))
        emb = np.asarray(pool(h, mask)["embedding"][0])
        ref = fixture["embeddings"][i]
        cos = emb @ ref / (np.linalg.norm(emb) * np.linalg.norm(ref))
        assert cos >= 0.99999, (i, cos)
    assert worst <= 1e-4, worst


def test_hf_checkpoint_round_trip(tmp_path):
    cfg = BERT_CONFIGS["bert-tiny-test"]
    model = init_bert(cfg, seed=3)
    export_hf_bert(model, tmp_path)
    cfg2, model2 = load_hf_bert(tmp_path)
    assert cfg2 == cfg
    ids = np.array([[101, 2023, 2003, 102, 0]], np.int32)
    mask = np.array([[1, 1, 1, 1, 0]], np.int32)
    np.testing.assert_array_equal(np.asarray(model(ids, mask)), np.asarray(model2(ids, mask)))


def test_import_rejects_mismatched_checkpoint(tmp_path):
    model = init_bert(BERT_CONFIGS["bert-tiny-test"])
    export_hf_bert(model, tmp_path)
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mlp_in"):
        load_hf_bert(tmp_path)
