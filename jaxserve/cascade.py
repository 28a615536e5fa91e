"""The data side of a Tabi cascade (the decisions are jaxserve/sched/tabi.py's): what a
level's input is, and how the next level's input is made from the small model's attention.

A cascade request's payload is a :class:`CascadeText`: its text, the token ids of the model
it goes to, the pruning degree alpha, and the models after it. The level's runtime runs the
ids and, when its executable outputs the attention importance vector (Eq. 5's ``I``: the
attention probability each token receives, summed over layers, heads and real query rows),
prunes the text for the next models (:func:`next_inputs`):

* a token is kept when ``I_j > alpha * mean(I)``, the mean taken over the tokens of words
  (special tokens always stay and are left out of the mean: [CLS] and [SEP] draw much of
  the attention, and counting them would prune more of a short text than of a long one);
* a word is pruned only if every one of its sub-tokens is (§4.2); a word is what the
  tokenizer's pre-tokenizer splits (punctuation marks are words of their own);
* the pruned text is the kept words with their original separators where they were
  adjacent and one space where words were dropped between them. Each next model tokenizes
  it with its own tokenizer (§4.2: the text is the only interface between models), so the
  input lands in the polymorph bucket of its own, shorter, length;
* pruning happens once, after the first level (as in the paper, whose cascades prune the
  large model's input with the efficient model's attention): the inputs it makes carry no
  alpha, so a middle level of a three-level cascade passes its pruned text on as it is;
* if nothing would be kept, nothing is pruned; an input longer than the next model's
  largest bucket (a different tokenizer can split more finely) is truncated to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class CascadeText:
    """One cascade level's input: ``ids`` (this level's tokenizer) of ``text``; ``alpha``:
    the pruning degree for the next levels (None: no pruning); ``next_models`` and their
    largest buckets ``limits``: the levels the request may still go to."""

    text: str
    ids: tuple[int, ...]
    alpha: float | None = None
    next_models: tuple[str, ...] = ()
    limits: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.ids)


def kept_words(importance: np.ndarray, word_of_token: Sequence[int | None], n_words: int, alpha: float) -> np.ndarray:
    """Which of ``n_words`` words survive Eq. 5 (bool [n_words]); see the module rules."""
    importance = np.asarray(importance, np.float64)
    word_tokens = [i for i, w in enumerate(word_of_token) if w is not None]
    keep = np.zeros(n_words, bool)
    if not word_tokens:
        return np.ones(n_words, bool)
    mean = importance[word_tokens].mean()
    for i in word_tokens:
        if importance[i] > alpha * mean:
            keep[word_of_token[i]] = True
    return keep if keep.any() else np.ones(n_words, bool)


def join_words(text: str, spans: Sequence[tuple[int, int]], keep: np.ndarray) -> str:
    """The kept words of ``text``: original separators between adjacent kept words, one
    space where words were dropped between them."""
    parts: list[str] = []
    last = None
    for w, (a, b) in enumerate(spans):
        if not keep[w]:
            continue
        if last is not None:
            parts.append(text[spans[last][1]:a] if last == w - 1 else " ")
        parts.append(text[a:b])
        last = w
    return "".join(parts)


def next_inputs(payload: CascadeText, importance: np.ndarray | None, tokenizer, tokenizer_for: Callable[[str], object]
                ) -> tuple[dict[str, CascadeText], int]:
    """The inputs of ``payload``'s next models after this level ran (``tokenizer``: this
    level's, which made ``payload.ids``; ``tokenizer_for(model)``: the next ones'), and how
    many tokens pruning took out of the first next model's input."""
    if not payload.next_models:
        return {}, 0
    text = payload.text
    if payload.alpha is not None and importance is not None:
        ids, word_of_token, spans = tokenizer.encode_words(text)
        if len(ids) != len(payload.ids):
            raise ValueError(f"the importance covers {len(payload.ids)} tokens; the text re-encodes to {len(ids)}")
        keep = kept_words(np.asarray(importance)[: len(ids)], word_of_token, len(spans), payload.alpha)
        text = join_words(payload.text, spans, keep)
    out = {}
    pruned = 0
    for i, (model, limit) in enumerate(zip(payload.next_models, payload.limits)):
        tok = tokenizer_for(model)
        ids = tok.encode([text])[0]
        if i == 0 and text != payload.text:
            pruned = max(0, len(tok.encode([payload.text])[0]) - len(ids))
        ids = tok.truncate(ids, limit)
        out[model] = CascadeText(text, tuple(ids), None, payload.next_models[i + 1:], payload.limits[i + 1:])
    return out, pruned


_TOKENIZERS: dict[str, object] = {}


def register_tokenizer(model: str, tokenizer) -> None:
    """Make ``tokenizer`` the one :func:`tokenizer_for` gives for ``model`` (a loaded runtime
    registers its own, so a cascade's next-level tokenizer is never loaded while a request waits)."""
    _TOKENIZERS[model] = tokenizer


def tokenizer_for(model: str):
    """The TextTokenizer of a registered text model: the one its loaded runtime registered, else
    read once from ``jaxserve.registry.text_tokenizer_path``."""
    tok = _TOKENIZERS.get(model)
    if tok is None:
        from jaxserve import registry
        from jaxserve.models.tokenizer import TextTokenizer

        tok = _TOKENIZERS[model] = TextTokenizer(registry.text_tokenizer_path(model))
    return tok


def truncated_text(tokenizer, text: str, max_tokens: int) -> tuple[str, list[int]]:
    """``text`` cut after its last whole word that fits ``max_tokens`` tokens (with the special
    tokens), and its ids: a cascade prunes and re-tokenizes the text itself, so a truncated
    request's text must be exactly what its first level ran, never a word cut in half."""
    ids, word_of_token, spans = tokenizer.encode_words(text)
    if len(ids) <= max_tokens:
        return text, ids
    room = max_tokens - (len(ids) - sum(w is not None for w in word_of_token))  # tokens left for words
    words = [w for w in word_of_token if w is not None]
    if room <= 0:
        return "", tokenizer.encode([""])[0]
    last = words[room - 1]
    if room < len(words) and words[room] == last:  # that word does not fit whole
        last -= 1
    cut = text[: spans[last][1]] if last >= 0 else ""
    return cut, tokenizer.encode([cut])[0]
