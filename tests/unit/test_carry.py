"""How a later step's activations are put together from the steps before it
(jaxserve.workers.gather_carry, CarryParts): in this process they are gathered at once;
where a source waits elsewhere (a Ray step's StoredCarry) only the recipe travels, and the
step's worker gathers it with the same rows in the same order."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.stages import Activations
from jaxserve.workers import CarryParts, StoredCarry, gather_carry


def acts(count: int, padded: int, base: float) -> Activations:
    hidden = base + np.arange(padded * 3 * 2, dtype=np.float32).reshape(padded, 3, 2)
    return Activations({"hidden": hidden, "mask": np.ones((padded, 3), np.int32)}, count)


def test_a_whole_source_in_order_is_passed_on_as_it_is():
    a = acts(3, 4, 0.0)
    assert gather_carry([(a, 0), (a, 1), (a, 2)]) is a


def test_rows_of_local_sources_are_gathered_in_the_step_order():
    a, b = acts(3, 4, 0.0), acts(2, 2, 100.0)
    out = gather_carry([(a, 2), (b, 1), (a, 0)])
    assert isinstance(out, Activations) and out.count == 3
    np.testing.assert_array_equal(out.arrays["hidden"], np.stack([a.arrays["hidden"][2], b.arrays["hidden"][1],
                                                                  a.arrays["hidden"][0]]))
    sub = gather_carry([(a, 1)])  # a subset of one source: its rows, unpadded
    assert sub.count == 1 and sub.arrays["hidden"].shape == (1, 3, 2)


def test_a_stored_source_makes_a_recipe_that_gathers_the_same_rows():
    a, b = acts(3, 4, 0.0), acts(2, 2, 100.0)
    stored = StoredCarry(ref="ref-a", count=3, holder=(1, 1), token=7)
    pairs = [(stored, 0), (stored, 2), (b, 1), (stored, 1)]
    recipe = gather_carry(pairs)
    assert isinstance(recipe, CarryParts) and recipe.count == 4
    # consecutive rows of one source form one part
    assert [(type(src).__name__, rows) for src, rows in recipe.parts] == [
        ("StoredCarry", (0, 2)), ("Activations", (1,)), ("StoredCarry", (1,))]
    got = recipe.gather(lambda src: {"ref-a": a}[src.ref])
    want = gather_carry([(a, 0), (a, 2), (b, 1), (a, 1)])
    np.testing.assert_array_equal(got.arrays["hidden"], want.arrays["hidden"])
    assert got.count == want.count == 4
    whole = gather_carry([(stored, 0), (stored, 1), (stored, 2)])
    assert whole is stored  # all of it, in order: passed on by name
    with pytest.raises(TypeError, match="object store"):
        recipe.gather()  # a worker that cannot read the store cannot resolve it


def test_rows_outside_a_source_are_refused():
    a = acts(2, 4, 0.0)
    with pytest.raises(IndexError, match="real rows"):
        CarryParts(((a, (0, 3)),)).gather()  # row 3 is padding
