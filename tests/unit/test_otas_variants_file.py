"""The INFaaS variants file bench/otas_infaas_variants.py writes and bench/otas_utility.py reads:
the checks that refuse a malformed one (naming the field), the anchoring of the variants' latencies
to the cost model through the served model, and the per-gamma correctness block of DINOv2's."""

import copy
import json

import numpy as np
import pytest

from bench.otas_utility import check_variants, load_gamma_correct, load_variants
from conftest import ROOT
from jaxserve.sched.base import Cell, LatencyProfile


def _variants():
    def one(name, scale, acc):
        return {"name": name, "latency": [[1, 0.1 * scale], [8, 0.5 * scale]],
                "accuracy": {"mnist": acc, "animals": acc - 0.1},
                "correct": {"mnist": [True, False, True], "animals": [False, False, True]}, "load_seconds": 2.0 * scale}

    return {"switch_seconds": 1.5, "variants": [one("m-d6", 0.5, 0.8), one("m", 1.0, 0.9)]}


def test_a_valid_file_passes():
    check_variants(_variants(), "m")


@pytest.mark.parametrize("change, field", [
    (lambda r: r.update(switch_seconds=-1), "switch_seconds"),
    (lambda r: r.update(switch_seconds=float("nan")), "switch_seconds"),
    (lambda r: r.update(variants=[]), "variants"),
    (lambda r: r["variants"][1].update(name="m-d6"), "unique"),
    (lambda r: r["variants"][1].update(name="other"), "no variant named 'm'"),
    (lambda r: r["variants"][0].pop("latency"), "latency"),
    (lambda r: r["variants"][0]["latency"].append([16, 0.0]), "seconds > 0"),
    (lambda r: r["variants"][0]["latency"].pop(), "batches"),
    (lambda r: r["variants"][0]["accuracy"].update(mnist=1.2), "[0, 1]"),
    (lambda r: r["variants"][0]["correct"].pop("animals"), "correct covers"),
    (lambda r: r["variants"][0]["correct"]["mnist"].append(True), "images per task"),
    (lambda r: r["variants"][0]["correct"].update(mnist=[1, 0, 1]), "booleans"),
    (lambda r: r["variants"][0].pop("load_seconds"), "m-d6: load_seconds"),
    (lambda r: r["variants"][1].update(load_seconds=-0.5), "m: load_seconds"),
    (lambda r: r["variants"][1].update(load_seconds=float("inf")), "m: load_seconds"),
    (lambda r: [v["accuracy"].update(extra=0.5) or v["correct"].update(extra=[True]) for v in r["variants"][:1]],
     "tasks"),
])
def test_a_malformed_file_is_refused_naming_the_field(change, field):
    raw = copy.deepcopy(_variants())
    change(raw)
    with pytest.raises(ValueError, match="variants.json") as err:
        check_variants(raw, "m", "variants.json")
    assert field in str(err.value)


def test_latencies_are_anchored_to_the_cost_model_through_the_served_model(tmp_path):
    """Per batch size, every variant is scaled by cost model / served model's own timing (then by
    ``factor``): the served model gets the cost model's latency exactly, the others keep their
    measured ratio to it. The switch cost is each variant's own measured load time, unscaled, and
    INFaaS takes it as given."""
    from jaxserve.sched.otas import INFaaSPolicy

    path = tmp_path / "v.json"
    path.write_text(json.dumps(_variants()))
    cost = LatencyProfile("m", {Cell(1, 0, 0): 0.2, Cell(8, 0, 0): 2.0})
    variants, switch, correct = load_variants(path, 0.5, cost, base="m")
    by_name = {v.name: v for v in variants}
    assert switch == {"infaas:m-d6": 1.0, "infaas:m": 2.0}  # each variant's own load time; I/O: not scaled
    assert INFaaSPolicy(variants, switch).switch_costs == switch
    assert by_name["infaas:m"].latency.latency_for(8, 0, 0) == pytest.approx(2.0 * 0.5)
    assert by_name["infaas:m-d6"].latency.latency_for(8, 0, 0) == pytest.approx(0.5 * 2.0 * 0.5)
    assert by_name["infaas:m-d6"].latency.latency_for(1, 0, 0) == pytest.approx(0.5 * 0.2 * 0.5)
    np.testing.assert_array_equal(correct["infaas:m"][("mnist", 0)], [True, False, True])
    with pytest.raises(ValueError, match="batch \\[8\\]"):  # a batch the cost model cannot anchor
        load_variants(path, 0.5, LatencyProfile("m", {Cell(1, 0, 0): 0.2}), base="m")


def test_gamma_correct_needs_every_gamma(tmp_path):
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"gamma_correct": {"mnist": {"0": [True, False], "-4": [True, True]}}}))
    table = load_gamma_correct(path, (-4, 0))
    np.testing.assert_array_equal(table[("mnist", -4)], [True, True])
    with pytest.raises(ValueError, match="lacks gammas \\[-8\\]"):
        load_gamma_correct(path, (-8, 0))


def test_the_shipped_files_pass():
    """The files the utility bench reads as committed (each when present)."""
    for name, base in (("otas_infaas_variants.json", "vit-demo"), ("otas_infaas_variants_dinov2-s14.json", "dinov2-s14")):
        path = ROOT / "bench" / name
        if path.exists():
            check_variants(json.loads(path.read_text()), base, name)
