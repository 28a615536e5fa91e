"""test_otas_serving.py's tests again, with every server's workers as Ray actors (``--workers ray``): the
same requests and checks, each step run by a worker actor in its own process (support.rerun_on_ray)."""

import pytest

pytest.importorskip("ray")

import test_otas_serving  # noqa: E402
from support import rerun_on_ray  # noqa: E402

globals().update(rerun_on_ray(test_otas_serving))
