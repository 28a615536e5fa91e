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


# The slowest test files, slowest first (measured serially on a 2-core host: the commit that added
# this list). `make test` runs files in parallel (pytest-xdist, --dist loadfile), handing them out
# in collection order as workers free up; started first, the long ones do not leave one worker
# running alone at the end. The sort is stable: order within a file is kept, and nothing else moves.
SLOW_FIRST = ("test_cli.py", "test_quart_serving.py", "test_compile_cache.py", "test_server_on_ray.py",
              "test_server.py", "test_ray_workers.py", "test_asyfunc_serving_on_ray.py", "test_asyfunc_serving.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
