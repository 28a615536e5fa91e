"""The native OTAS DP (jaxserve/kernels/otas_dp.c, called by jaxserve.sched.otas.solve_token_dp):
the same DPSolution as the Python/numpy stages to the bit, taken where it should be, built like
the attention kernel (trusted owner-only directory), and out of the way where it cannot answer.

The library is compiled once per machine (under a second) into the kernel directory; each test
then runs in well under a second or two.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

import jaxserve.sched.otas as otas_module
from jaxserve import kernels
from jaxserve.sched.otas import DPSolution, GammaOption, _DPStage, _dp_native, _undominated, solve_token_dp
from test_otas_sched import _reference_token_dp, count_calls


@pytest.fixture(scope="module")
def native():
    if kernels._c_compiler() is None:
        pytest.skip("no C compiler on this machine")
    built = kernels.otas_dp_library()
    assert built is not None, "a C compiler is here, yet the native DP did not build (see the warning)"
    return built


def _bits(x: float) -> str:
    return float(x).hex()  # tells -0.0 from 0.0


def _same(got: DPSolution, want: DPSolution) -> None:
    assert got.gammas == want.gammas
    assert type(got.utility) is float and type(got.finish) is float
    assert _bits(got.utility) == _bits(want.utility) and _bits(got.finish) == _bits(want.finish)
    assert (got.max_frontier, got.truncated) == (want.max_frontier, want.truncated)
    assert type(got.max_frontier) is int and type(got.truncated) is bool


def _old_path(monkeypatch, *args, **kwargs) -> DPSolution:
    """solve_token_dp through the Python/numpy stages."""
    with monkeypatch.context() as m:
        m.setenv("JAXSERVE_NATIVE_DP", "0")
        return solve_token_dp(*args, **kwargs)


KINDS = ("dyadic", "uniform", "near", "zero", "huge", "rounding", "signed")


def _random_dp(rng: random.Random, kind: str):
    """(deadlines, options, start) of a random queue built for one of the hard cases: equal clocks
    (dyadic seconds), utilities equal exactly or up to rounding (sums of 0.1, 0.2, 0.3), utilities
    within 1e-9 relative of each other, zero seconds and utilities, large magnitudes, clocks so large
    that adding a step rounds two labels onto one clock, negative steps and utilities; deadlines that
    cut, infinite or NaN; starts of either sign of zero, infinite or large."""
    n = rng.choice([0, 1, 1, 2, 3, 5, 8, 15, 25, 40])
    start = rng.choice([0.0, -0.0, 0.0, rng.uniform(0, 5)])
    if kind == "rounding":
        start = rng.choice([2.0 ** 53 - rng.randint(0, 64), 1e17, 2.0 ** 60 + rng.randint(0, 3) * 256.0])
    elif kind == "huge":
        start = rng.choice([0.0, 1e9, 3e12])
    elif rng.random() < 0.05:
        start = rng.choice([math.inf, -math.inf])
    options, deadlines, clock = [], [], start
    for _ in range(n):
        opts = []
        for g in rng.sample(range(-4, 9), rng.randint(1, 6)):
            if kind == "dyadic":
                seconds, utility = rng.choice([0.125, 0.25, 0.375, 0.5]), rng.choice([0.1, 0.2, 0.3, 0.7]) * rng.choice([1, 2, 3])
            elif kind == "uniform":
                seconds, utility = rng.uniform(0.01, 0.3), rng.uniform(0, 2)
            elif kind == "near":
                base = rng.choice([0.3, 0.1 + 0.2, 1.0, 7.7, 1234.5])
                utility = base * (1 + rng.choice([0.0, 1e-10, -4e-10, 9e-10, 1.1e-9, -2e-9, 5e-9, 1e-12, 0.5]))
                seconds = rng.choice([0.125, 0.25, rng.uniform(0.01, 0.3)])
            elif kind == "zero":
                seconds, utility = rng.choice([0.0, -0.0, 0.25, 0.5]), rng.choice([0.0, -0.0, 0.1, 0.3])
            elif kind == "huge":
                seconds, utility = rng.choice([0.25, 1e-6, 1e6, rng.uniform(0, 3)]), rng.choice([3e11, 1e-300, 2.5e15, rng.uniform(0, 1e12)])
            elif kind == "rounding":
                seconds = rng.choice([1.0, 3.0, 2.0 ** 53 + 2, 255.0, 1e16 + rng.randint(0, 9), rng.uniform(0, 500)])
                utility = rng.choice([0.1, 0.2, 0.3, 1.0])
            else:  # signed: negative steps and utilities
                seconds, utility = rng.uniform(-0.2, 0.3), rng.uniform(-1, 2)
            opts.append(GammaOption(g, seconds, utility))
        clock += rng.uniform(0.05, 0.3)
        options.append(opts)
        deadlines.append(rng.choice([clock, clock * 2, start + rng.uniform(0, 1), math.inf, math.inf, math.nan,
                                     -math.inf, 0.0]))
    return deadlines, options, start


def test_native_equals_the_python_stages_and_the_plain_transcription_to_the_bit(native, monkeypatch):
    """Thousands of random DPs (every kind above, thinned hard and not at all): the native DP, its
    slow path (every stage sorted) and the Python/numpy stages give the same DPSolution, to the bit;
    with utilities that are not negative, so does the plain transcription of Alg. 2."""
    used = count_calls(monkeypatch, otas_module, {"_dp_native": "native"})
    rng = random.Random(2024)
    trials = truncated = shared = 0
    for trial in range(2100):
        kind = KINDS[trial % len(KINDS)]
        deadlines, options, start = _random_dp(rng, kind)
        executors = rng.choice([1, 1, 2, 3, 7, 100])  # m > 1: a label's clock moves on by seconds / m
        for max_labels in rng.sample([2, 3, 7, 64, 128], 2):
            got = solve_token_dp(deadlines, options, start, max_labels, executors=executors)
            _same(got, _old_path(monkeypatch, deadlines, options, start, max_labels, executors=executors))
            stages = [_DPStage(_undominated(o)) for o in options]
            _same(_dp_native(deadlines, options, stages, start, max_labels, sort_all=True, executors=executors), got)
            if kind != "signed":
                _same(got, _reference_token_dp(deadlines, options, start, max_labels, executors))
            trials += 1
            truncated += got.truncated
            shared += executors > 1 and got.truncated
    assert used["native"] == trials  # every one went native (none of these overflows)
    assert truncated > 500 and shared > 150


def test_native_takes_the_policy_s_stages_and_the_old_path_when_switched_off(native, monkeypatch):
    """With the policy's kept stages (``undominated``), the native DP answers (not None) and gives what
    the Python/numpy stages give; ``JAXSERVE_NATIVE_DP=0`` (or false/no/off) never calls it."""
    answers = []
    real = otas_module._dp_native
    monkeypatch.setattr(otas_module, "_dp_native", lambda *a, **k: answers.append(real(*a, **k)) or answers[-1])
    rng = random.Random(9)
    for trial in range(40):
        deadlines, options, start = _random_dp(rng, KINDS[trial % 3])
        stages = [_DPStage(_undominated(o)) for o in options]
        got = solve_token_dp(deadlines, options, start, undominated=stages)
        assert len(answers) == trial + 1 and answers[-1] is got
        for off in ("0", "false", " No ", "OFF"):
            monkeypatch.setenv("JAXSERVE_NATIVE_DP", off)
            _same(solve_token_dp(deadlines, options, start, undominated=stages), got)
        monkeypatch.delenv("JAXSERVE_NATIVE_DP")
        assert len(answers) == trial + 1


def test_equal_clocks_at_a_column_head_take_the_sorting_path(native, monkeypatch):
    """Two labels one unit in the last place apart, plus a step that rounds both onto one clock: the
    column's head is then not its least candidate (the later label has the higher utility), which the
    fast path hands to the sort. Same answer as the Python stages and the transcription."""
    a, b = 2.0 ** 53 - 2, 2.0 ** 53 - 1  # one apart; clocks of 2**54 and above are 4 apart
    step = 2.0 ** 53 + 2
    assert a + step == b + step
    first = [GammaOption(0, 1.0, 0.5)]  # from a: label (a + 1 = b, 0.5) beside the skip (a, 0)
    second = [GammaOption(1, step, 1.0), GammaOption(2, 4.0 * step, 2.0)]
    # (b + step, 1.5) comes before (a + step, 1.0), which is then not kept; taking the column's head
    # first would keep both (one label more)
    for deadline, want, width in ((2.0 ** 55, (0, 1), 3), (math.inf, (0, 2), 4)):
        deadlines, options = [math.inf, deadline], [first, second]
        got = solve_token_dp(deadlines, options, a)
        _same(got, _old_path(monkeypatch, deadlines, options, a))
        _same(got, _reference_token_dp(deadlines, options, a))
        assert got.gammas == want and got.max_frontier == width


def test_edge_shapes(native, monkeypatch):
    """No batch, one batch, nothing fits, a NaN deadline, a signed-zero start: native and old agree."""
    cases = [
        ([], [], 0.0), ([], [], -0.0), ([], [], math.inf),
        ([1.0], [[GammaOption(0, 0.5, 1.0)]], -0.0),
        ([0.25], [[GammaOption(0, 0.5, 1.0)]], -0.0),
        ([math.nan], [[GammaOption(0, 0.5, 1.0)]], 0.0),
        ([math.inf], [[GammaOption(0, 0.0, 0.0), GammaOption(1, -0.0, -0.0)]], -0.0),
        ([math.inf] * 3, [[GammaOption(g, 0.1 * g, 0.3 * g) for g in range(5)]] * 3, -math.inf),
    ]
    for deadlines, options, start in cases:
        for max_labels in (2, 128):
            _same(solve_token_dp(deadlines, options, start, max_labels),
                  _old_path(monkeypatch, deadlines, options, start, max_labels))


def test_nan_inputs_take_the_old_path(native, monkeypatch):
    """A NaN start or a non-finite undominated option: the native DP is not called; the stages run as
    before. (A dominated option is dropped before the DP: it does not count.)"""
    used = count_calls(monkeypatch, otas_module, {"_dp_native": "native", "_dp_stage_python": "python"})
    options = [[GammaOption(0, 0.25, 1.0), GammaOption(1, 0.5, 2.0)] for _ in range(6)]
    solve_token_dp([math.inf] * 6, options, math.nan)
    for seconds, utility in ((math.nan, 2.0), (math.inf, 2.0), (-math.inf, 2.0), (0.5, math.nan), (0.5, math.inf)):
        broken = [list(o) for o in options]
        broken[3][1] = GammaOption(1, seconds, utility)
        solve_token_dp([math.inf] * 6, broken, 0.0)
    assert used["native"] == 0 and used["python"] > 0
    solve_token_dp([math.inf] * 6, options, 0.0)
    broken[3][1] = GammaOption(1, 0.5, -math.inf)  # dominated by option 0
    solve_token_dp([math.inf] * 6, broken, 0.0)
    assert used["native"] == 2


def test_numbers_python_reads_otherwise_take_the_old_path(native, monkeypatch):
    """The native DP reads doubles; Python's arithmetic reads a float32 (numpy's promotion) or a
    Decimal otherwise, so those go the old path; floats, ints and numpy float64 go native."""
    import numpy as np
    from decimal import Decimal

    used = count_calls(monkeypatch, otas_module, {"_dp_native": "native"})
    options = [[GammaOption(0, 0.25, 1.0), GammaOption(1, 0.5, 2.0)] for _ in range(3)]
    solve_token_dp([1.0] * 3, [[GammaOption(0, np.float32(0.25), 1.0)]] + options[1:], 0.0)
    with pytest.raises(TypeError):  # as before: float - Decimal
        solve_token_dp([1.0] * 3, [[GammaOption(0, 0.25, Decimal("1"))]] + options[1:], 0.0)
    solve_token_dp([1.0, np.float32(1.0), 1.0], options, 0.0)
    solve_token_dp([1.0] * 3, options, np.float32(0.0))
    solve_token_dp([1.0] * 3, options, 0.0, np.int64(8))
    assert used["native"] == 0
    solve_token_dp([1, np.float64(1.0), math.inf], [[GammaOption(0, 1, 2)]] + options[1:], np.float64(0.0), 8)
    assert used["native"] == 1


def test_a_utility_sum_that_overflows_takes_the_old_path(native, monkeypatch):
    """Finite options whose utility sum overflows to infinity: the native DP declines (the Python and
    numpy stages' near-tie shortcuts may part there), and the stages answer."""
    answers = []
    real = otas_module._dp_native
    monkeypatch.setattr(otas_module, "_dp_native", lambda *a, **k: answers.append(real(*a, **k)) or answers[-1])
    options = [[GammaOption(0, 0.25, 1e308), GammaOption(1, 0.5, 1.7e308)] for _ in range(4)]
    got = solve_token_dp([math.inf] * 4, options, 0.0)
    assert answers == [None]
    _same(got, _old_path(monkeypatch, [math.inf] * 4, options, 0.0))


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path, caplog):
    """No usable C compiler: building raises naming it and leaves nothing behind; the DP then runs in
    Python/numpy with one warning, whatever the number of calls."""
    monkeypatch.setattr(kernels, "_c_compiler", lambda: "/bin/false")
    monkeypatch.setenv("JAXSERVE_KERNEL_DIR", str(tmp_path / "kernels"))
    with pytest.raises(RuntimeError, match="false failed"):
        kernels.build_otas_dp()
    assert not list((tmp_path / "kernels").glob("*.so"))
    monkeypatch.setattr(kernels, "_c_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        kernels.build_otas_dp()
    used = count_calls(monkeypatch, otas_module, {"_dp_stage_python": "python"})
    kernels.otas_dp_library.cache_clear()
    try:
        options = [[GammaOption(0, 0.25, 1.0), GammaOption(1, 0.5, 2.0)] for _ in range(3)]
        with caplog.at_level("WARNING", logger="jaxserve.kernels"):
            first = solve_token_dp([1.0] * 3, options, 0.0)
            second = solve_token_dp([1.0] * 3, options, 0.0)
        assert caplog.text.count("native OTAS DP unavailable") == 1
        assert used["python"] == 6 and first == second
    finally:
        kernels.otas_dp_library.cache_clear()


def test_a_kernel_directory_others_can_write_is_refused(tmp_path):
    """The DP library is native code this process loads, like the attention kernel: a directory or a
    library another user could write is refused; ours are 0700."""
    if kernels._c_compiler() is None:
        pytest.skip("no C compiler on this machine")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        kernels.build_otas_dp(shared)
    assert not list(shared.glob("*.so"))
    ours = tmp_path / "ours"
    built = kernels.build_otas_dp(ours)
    assert built.built_seconds > 0 and built.path.name == f"otas_dp-{built.build_id}.so"
    assert oct(ours.stat().st_mode & 0o777) == "0o700" and oct(built.path.stat().st_mode & 0o777) == "0o700"
    again = kernels.build_otas_dp(ours)
    assert again.path == built.path and again.built_seconds == 0.0  # reused
    built.path.chmod(0o770)  # tampered with: a group member could have replaced it
    with pytest.raises(PermissionError, match="writable by others"):
        kernels.build_otas_dp(ours)


def test_the_native_path_imports_no_jax(native):
    """The schedulers stay free of jax: solving a DP natively (building the library if need be)
    imports none."""
    code = ("import sys; import jaxserve.sched.otas as o; from jaxserve.kernels import otas_dp_library; "
            "o.solve_token_dp([1.0], [[o.GammaOption(0, 0.5, 1.0)]], 0.0); "
            "assert otas_dp_library() is not None; print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_making_an_image_policy_builds_the_native_dp_before_any_request(native):
    """launch.make_policy (the server's start, and simulate's) loads the library, so the first DP a
    live server solves never waits for a C compiler."""
    from jaxserve.launch import ServeSettings, make_policy
    from jaxserve.sched.base import CostModel
    from test_otas_sched import ACCP, LAT, _Runtime

    kernels.otas_dp_library.cache_clear()
    make_policy(ServeSettings(policy="default"), {"vit": _Runtime(ACCP)}, CostModel(latency={"vit": LAT}))
    assert kernels.otas_dp_library.cache_info().currsize == 0  # only the image policies solve the DP
    make_policy(ServeSettings(policy="otas"), {"vit": _Runtime(ACCP)}, CostModel(latency={"vit": LAT}))
    assert kernels.otas_dp_library.cache_info().currsize == 1
