"""WordPiece tokenization from an HF ``tokenizer.json`` (the ``tokenizers`` library).

The packaged tokenizer.json pads and truncates to 128 by default; both are turned off
here because the polymorph buckets decide the padded length, and a too-long input is
the caller's decision (reject, or truncate explicitly), never a silent cut.

The special tokens are read from the file, not assumed: BERT's [CLS]/[SEP]/[PAD] (MiniLM,
101/102/0) or RoBERTa-style <s>/</s>/<pad> (MPNet, 0/2/1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer


_SEQUENTIAL_UP_TO = 16  # texts
_SEQUENTIAL_CHARS = 16_384  # characters in all


def _special_ids(spec: dict) -> tuple[int | None, int | None, int | None]:
    """(cls, sep, pad) ids a tokenizer.json declares: cls and sep from its post-processor
    (TemplateProcessing's single-sequence template: the special token before the sequence and
    the last one after it; BertProcessing / RobertaProcessing: their ``cls`` and ``sep``; a
    Sequence of processors: the first that names them), pad from its padding settings. None
    where the file does not say."""
    cls = sep = None

    def visit(proc: dict | None) -> None:
        nonlocal cls, sep
        if not proc:
            return
        kind = proc.get("type")
        if kind in ("BertProcessing", "RobertaProcessing"):
            cls, sep = cls if cls is not None else proc["cls"][1], sep if sep is not None else proc["sep"][1]
        elif kind == "TemplateProcessing":
            ids = {name: entry["ids"][0] for name, entry in proc.get("special_tokens", {}).items() if entry.get("ids")}
            single = proc.get("single", [])
            seq = next((i for i, piece in enumerate(single) if "Sequence" in piece), None)
            if seq is None:
                return
            before = [p["SpecialToken"]["id"] for p in single[:seq] if "SpecialToken" in p]
            after = [p["SpecialToken"]["id"] for p in single[seq + 1:] if "SpecialToken" in p]
            if cls is None and before and before[0] in ids:
                cls = ids[before[0]]
            if sep is None and after and after[-1] in ids:
                sep = ids[after[-1]]
        elif kind == "Sequence":
            for sub in proc.get("processors", []):
                visit(sub)

    visit(spec.get("post_processor"))
    padding = spec.get("padding") or {}
    pad = padding.get("pad_id")
    return cls, sep, pad


def _first(*ids: int | None) -> int | None:
    return next((i for i in ids if i is not None), None)


class TextTokenizer:
    """An HF tokenizer.json without padding or truncation, and its special ids.

    ``cls_id``, ``sep_id`` and ``pad_id`` come from the file (:func:`_special_ids`), else
    from the tokens [CLS] / <s>, [SEP] / </s>, [PAD] / <pad> by name (pad: else 0); an
    argument given here overrides the file. ``sep_id`` is what :meth:`truncate` ends with,
    ``pad_id`` what runtimes pad a bucket with."""

    def __init__(self, tokenizer_json: str | Path, *, cls_id: int | None = None, sep_id: int | None = None,
                 pad_id: int | None = None):
        self._tok = Tokenizer.from_file(str(tokenizer_json))
        self._tok.no_padding()
        self._tok.no_truncation()
        file_cls, file_sep, file_pad = _special_ids(json.loads(Path(tokenizer_json).read_text(encoding="utf-8")))

        def by_name(*names: str) -> int | None:
            return next((i for i in map(self._tok.token_to_id, names) if i is not None), None)

        self.cls_id = _first(cls_id, file_cls, by_name("[CLS]", "<s>"))
        self.sep_id = _first(sep_id, file_sep, by_name("[SEP]", "</s>"))
        self.pad_id = _first(pad_id, file_pad, by_name("[PAD]", "<pad>"), 0)

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
        """Keep the first ``max_tokens - 1`` tokens and close with the sep token ([SEP], </s>),
        as HF truncation does."""
        if len(ids) <= max_tokens:
            return list(ids)
        return list(ids[: max_tokens - 1]) + [self.sep_id]
