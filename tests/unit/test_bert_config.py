"""BertConfig <-> HF config.json, for both families (export, the ONNX converters and from_hf agree)."""

import pytest

from jaxserve.models.bert import BERT_CONFIGS, BertConfig

MPNET = BertConfig(vocab_size=30527, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
                   max_position=514, type_vocab_size=0, layer_norm_eps=1e-5, pad_token_id=1, family="mpnet",
                   relative_attention_num_buckets=32)


@pytest.mark.parametrize("cfg", [BERT_CONFIGS["minilm-l6"], MPNET], ids=["bert", "mpnet"])
def test_to_hf_reads_back_into_the_same_config_and_key(cfg):
    hf = cfg.to_hf()
    assert hf["model_type"] == cfg.family
    back = BertConfig.from_hf(hf)
    assert back == cfg and back.key() == cfg.key()


def test_a_different_bucket_count_is_refused():
    hf = MPNET.to_hf() | {"relative_attention_num_buckets": 64}
    with pytest.raises(ValueError, match="32 relative attention buckets"):
        BertConfig.from_hf(hf)
