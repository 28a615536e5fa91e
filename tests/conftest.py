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


# The slowest test files, slowest first: their times with `make test`'s two processes on a 2-core
# host (the commit that changed this list says when), where the Ray-heavy files take up to 1.8x
# their time alone. `make test` runs files in parallel (pytest-xdist, --dist loadfile) and hands
# them out in this order as workers free up (--no-loadscope-reorder: xdist would otherwise order
# files by their number of tests); started first, the long ones do not leave one worker running
# alone at the end. The sort is stable: order within a file is kept, and the files not named here
# follow in collection order.
SLOW_FIRST = ("test_quart_serving.py", "test_cli.py", "test_asyfunc_serving_on_ray.py", "test_server_on_ray.py",
              "test_compile_cache.py", "test_server.py", "test_asyfunc_serving.py", "test_ray_workers.py",
              "test_mpnet.py", "test_dinov2.py", "test_bench_harness.py", "test_onnx_berts.py", "test_asyfunc_split.py",
              "test_keys_manager.py", "test_ray_server.py", "test_attention.py", "test_stages.py", "test_prompts.py",
              "test_tabi_sentiment.py", "test_vit.py", "test_precision.py", "test_tabi_server.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
