"""WordPiece tokenization from an HF ``tokenizer.json`` (the ``tokenizers`` library).

The packaged tokenizer.json pads and truncates to 128 by default; both are turned off
here because the polymorph buckets decide the padded length, and a too-long input is
the caller's decision (reject, or truncate explicitly), never a silent cut.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer


_SEQUENTIAL_UP_TO = 16  # texts
_SEQUENTIAL_CHARS = 16_384  # characters in all


class TextTokenizer:
    def __init__(self, tokenizer_json: str | Path):
        self._tok = Tokenizer.from_file(str(tokenizer_json))
        self._tok.no_padding()
        self._tok.no_truncation()
        self.sep_id = self._tok.token_to_id("[SEP]")
        self.cls_id = self._tok.token_to_id("[CLS]")
        self.pad_id = self._tok.token_to_id("[PAD]") or 0

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text. A few texts (a serving request) are encoded one by one on the
        calling thread: ``encode_batch`` hands even one text to the library's worker pool,
        and under load, with XLA's threads on the same cores, py-spy attributed ~0.5 ms per
        request on the event loop to it, against ~30 us for the encoding itself (the load
        test's knee did not move measurably either way)."""
        if self.cheap(texts):
            return [self._tok.encode(t).ids for t in texts]
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def encode_words(self, text: str) -> tuple[list[int], list[int | None], list[tuple[int, int]]]:
        """(ids, word index of each token (None for special tokens), each word's character
        span in ``text``, in word order): what word-level pruning needs to map tokens back
        to the words they came from (jaxserve.cascade)."""
        enc = self._tok.encode(text)
        spans: dict[int, tuple[int, int]] = {}
        for w, (a, b) in zip(enc.word_ids, enc.offsets):
            if w is not None:
                lo, hi = spans.get(w, (a, b))
                spans[w] = (min(lo, a), max(hi, b))
        order = sorted(spans)
        index = {w: i for i, w in enumerate(order)}
        return list(enc.ids), [None if w is None else index[w] for w in enc.word_ids], [spans[w] for w in order]

    @staticmethod
    def cheap(texts: Sequence[str]) -> bool:
        """Few and short enough to encode one by one on the calling thread (microseconds).
        Anything larger goes through ``encode_batch``, which releases the GIL (``encode``
        holds it: 64 texts of 130k characters held it 3.7 s), so a server can run it on a
        worker thread while its event loop keeps answering."""
        return len(texts) <= _SEQUENTIAL_UP_TO and sum(map(len, texts)) <= _SEQUENTIAL_CHARS

    def truncate(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        """Keep the first ``max_tokens - 1`` tokens and close with [SEP], as HF truncation does."""
        if len(ids) <= max_tokens:
            return list(ids)
        return list(ids[: max_tokens - 1]) + [self.sep_id]
