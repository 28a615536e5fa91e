"""Tabi's word pruning (jaxserve/cascade.py) on the real MiniLM tokenizer."""

import numpy as np

from jaxserve.cascade import CascadeText, join_words, kept_words, next_inputs, tokenizer_for


TEXT = "This paper is beautifully written, and enjoyable to read!"


def test_a_word_is_pruned_only_if_all_its_tokens_are_and_special_tokens_stay_out_of_the_mean():
    word_of_token = [None, 0, 1, 1, 2, None]  # [CLS] w0 w1 w1' w2 [SEP]
    # the specials' huge importance must not raise the bar: the mean over word tokens is 0.775
    imp = np.array([50.0, 1.5, 0.2, 1.2, 0.2, 50.0])
    assert kept_words(imp, word_of_token, 3, alpha=1.0).tolist() == [True, True, False]
    # w1 survives through one of its two tokens; higher alpha drops it too
    assert kept_words(imp, word_of_token, 3, alpha=1.6).tolist() == [True, False, False]
    # nothing above the bar: nothing is pruned
    assert kept_words(np.ones(6), word_of_token, 3, alpha=2.0).all()


def test_join_keeps_original_separators_between_adjacent_words():
    spans = [(0, 4), (5, 10), (11, 13), (14, 25), (25, 26)]
    text = "This paper is beautifully."
    assert join_words(text, spans, np.array([1, 1, 0, 1, 1], bool)) == "This paper beautifully."
    assert join_words(text, spans, np.array([0, 1, 1, 0, 0], bool)) == "paper is"


def test_next_inputs_prune_by_importance_and_retokenize_for_each_next_model():
    tok = tokenizer_for("minilm-l6")
    ids, word_of_token, spans = tok.encode_words(TEXT)
    importance = np.ones(len(ids))
    important = {"beautifully", "enjoyable", "written"}
    for i, w in enumerate(word_of_token):
        if w is not None and TEXT[spans[w][0]:spans[w][1]] in important:
            importance[i] = 5.0
    payload = CascadeText(TEXT, tuple(ids), 1.0, ("minilm-l3", "minilm-l6"), (64, 8))
    out, pruned = next_inputs(payload, importance, tok, tokenizer_for)
    nxt = out["minilm-l3"]
    assert nxt.text == "beautifully written enjoyable"
    assert list(nxt.ids) == tok.encode([nxt.text])[0]
    assert pruned == len(ids) - len(nxt.ids) > 0
    assert nxt.alpha is None and nxt.next_models == ("minilm-l6",) and nxt.limits == (8,)  # pruned once
    assert len(out["minilm-l6"].ids) <= 8 and out["minilm-l6"].ids[-1] == tok.sep_id  # truncated to its limit
    # no alpha (or no importance): the whole text goes on, re-tokenized
    out, pruned = next_inputs(CascadeText(TEXT, tuple(ids), None, ("minilm-l3",), (64,)), importance, tok,
                              tokenizer_for)
    assert out["minilm-l3"].text == TEXT and pruned == 0
    # the last level makes no next inputs
    assert next_inputs(CascadeText(TEXT, tuple(ids), 1.0), importance, tok, tokenizer_for) == ({}, 0)


def test_a_truncated_cascade_text_ends_at_a_whole_word_and_matches_its_ids():
    from jaxserve.cascade import truncated_text

    tok = tokenizer_for("minilm-l6")
    text = "This is unbelievably long text with words"
    for limit in range(3, 16):
        cut, ids = truncated_text(tok, text, limit)
        assert len(ids) <= limit and ids == tok.encode([cut])[0]
        assert text.startswith(cut) and (cut == text or text[len(cut)] == " ")  # never half a word
    assert truncated_text(tok, text, 5)[0] == "This is"  # "unbelievably" is 5 tokens: it does not fit
    assert truncated_text(tok, text, 64)[0] == text
