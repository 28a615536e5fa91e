"""Policies that need only one stage behave as before: the simulated outcome, start and
finish time and cell of every request equal the golden fixture's (times within 1e-9).

The fixture (tests/fixtures/one_stage_golden.json) was made by
tests/fixtures/make_one_stage_golden.py, whose runs this test re-simulates.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from conftest import FIXTURES


def _generator():
    spec = importlib.util.spec_from_file_location("make_one_stage_golden", FIXTURES / "make_one_stage_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()
GOLDEN = json.loads((FIXTURES / "one_stage_golden.json").read_text())["runs"]


def test_the_fixture_covers_every_run():
    assert sorted(GOLDEN) == sorted(GEN.RUNS)


@pytest.mark.parametrize("name", sorted(GEN.RUNS))
def test_simulated_run_equals_the_golden_fixture(name):
    want, got = GOLDEN[name], GEN.simulate_run(name)
    assert len(got["outcome"]) == len(want["outcome"])
    bad = [i for i, (a, b) in enumerate(zip(got["outcome"], want["outcome"])) if a != b]
    assert not bad, f"{len(bad)} outcomes differ, first at request {bad[0]}"
    assert got["cell"] == want["cell"]
    for key in ("start", "finish"):
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            if a is None or b is None:
                assert a is None and b is None, f"{key} of request {i}: {a} != {b}"
            else:
                assert math.isclose(a, b, rel_tol=0.0, abs_tol=1e-9), f"{key} of request {i}: {a} != {b}"
