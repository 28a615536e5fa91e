import os

# Tests run on the CPU with small thread pools; they never need a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).parent.parent  # the repository
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from jaxserve.registry import minilm_dir

    return minilm_dir()


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    from jaxserve.models.bert import load_hf_bert

    return load_hf_bert(minilm_dir)
