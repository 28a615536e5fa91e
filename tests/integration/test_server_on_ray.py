"""test_server.py's tests again, with every server's workers as Ray actors (``--workers ray``): the
same requests and checks, each step run by a worker actor in its own process (support.rerun_on_ray),
but for test_server.SAME_ON_ANY_WORKERS (TLS and the API key: nothing there reaches a worker)."""

import pytest

pytest.importorskip("ray")

import test_server  # noqa: E402
from support import rerun_on_ray  # noqa: E402

globals().update(rerun_on_ray(test_server))
