"""The licence guard of the prompt repository: a repository holding a benchmark-only task (elpv,
CC-BY-NC-SA-4.0: ``prompts.BENCHMARK_ONLY_LICENCES``) is never saved inside the jaxserve package,
so nothing trained on that data can be bundled; anywhere else it saves and loads as any other.

Contracts checked: ``PromptRepository.save`` into the package (its assets folder, the package
itself, or a path that reaches it through a symlink or ``..``) raises ValueError naming the task,
the licence and the path, before anything is written; the same repository saves outside the
package and reads back; a repository of served tasks only is not refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import jaxserve
from jaxserve.prompts import BENCHMARK_ONLY_LICENCES, PromptEntry, PromptRepository, refuse_bundling

PACKAGE = Path(jaxserve.__file__).resolve().parent
D, C = 4, 4


def repository(*tasks: str) -> PromptRepository:
    repo = PromptRepository("key", num_layers=2, hidden_size=D)
    for i, task in enumerate(tasks):
        w = np.full((D, C), i + 1, np.float32)
        repo.add(PromptEntry(task, 0, None, w, np.arange(C, dtype=np.float32), 0.5), [f"c{k}" for k in range(C)])
    return repo


@pytest.mark.parametrize("inside", [
    PACKAGE / "assets" / "dinov2-s14-elpv-never-written",
    PACKAGE / "assets" / ".." / "elpv-never-written",
])
def test_a_benchmark_only_task_is_never_saved_inside_the_package(inside):
    assert not inside.exists()
    before = sorted(p.name for p in PACKAGE.iterdir())
    try:
        with pytest.raises(ValueError) as err:
            repository("mnist", "elpv").save(inside)
    finally:  # a broken guard must not leave a repository in the package
        if inside.exists():
            shutil.rmtree(inside)
    message = str(err.value)
    assert "'elpv'" in message and BENCHMARK_ONLY_LICENCES["elpv"] in message and "CC-BY-NC-SA" in message
    assert str(inside.resolve()) in message
    assert not (inside / "repository.json").exists() and not (inside / "state").exists()
    assert sorted(p.name for p in PACKAGE.iterdir()) == before  # nothing created


def test_a_symlink_into_the_package_is_followed_and_refused(tmp_path):
    link = tmp_path / "looks-harmless"
    link.symlink_to(PACKAGE / "assets", target_is_directory=True)
    try:
        with pytest.raises(ValueError, match="benchmark-only"):
            repository("elpv").save(link / "elpv-probe")
    finally:
        written = (PACKAGE / "assets" / "elpv-probe").exists()
        shutil.rmtree(PACKAGE / "assets" / "elpv-probe", ignore_errors=True)
    assert not written


def test_outside_the_package_it_saves_and_loads(tmp_path):
    out = tmp_path / "compiled_cache" / "elpv-probe"
    repository("mnist", "elpv").save(out)
    back = PromptRepository.load(out)
    assert set(back.tasks) == {"elpv", "mnist"}
    np.testing.assert_array_equal(back.entry("elpv", 0).head_w, np.full((D, C), 2, np.float32))


def test_served_tasks_alone_are_not_refused():
    refuse_bundling(("mnist", "animals"), PACKAGE / "assets" / "dinov2-s14-prompts")  # no error
    for inside in (PACKAGE / "assets" / "dinov2-s14-prompts", PACKAGE):  # checked without writing anything
        with pytest.raises(ValueError, match="'elpv'"):
            refuse_bundling(("mnist", "elpv"), inside)
    refuse_bundling(("elpv",), PACKAGE.parent / "compiled_cache" / "elpv-probe")  # beside the package: allowed
