"""The benchmark harness (bench.common, bench.all, bench.status, bench.headline) on tiny inputs,
so the scripts cannot rot: declarations complete and readable, the driver's plan, staleness on a
temporary RESULTS.md, the README table generated into a temporary copy, and two cheap scripts'
``--quick`` runs into a temporary directory. Never writes bench/RESULTS.md or README.md (each
test that could checks the real files' bytes are unchanged), never depends on timings.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import all as bench_all
from bench import common, headline, status

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "RESULTS.md"
README = ROOT / "README.md"

needs_git = pytest.mark.skipif(not common.git("rev-parse", "HEAD"), reason="not a git checkout")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def real_files_untouched():
    """Fails the test if it changed bench/RESULTS.md or README.md."""
    before = {p: _digest(p) for p in (RESULTS, README)}
    yield
    for p, h in before.items():
        assert _digest(p) == h, f"the test modified {p}"


def _run(args: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# ---------------------------------------------------------------- declarations

def test_every_writing_script_declares_its_sections_and_existing_files():
    decl = common.declared_scripts()
    for f in sorted((ROOT / "bench").glob("*.py")):
        text = f.read_text()
        if re.search(r"\brecord\(|\bsplice\(|\bsection\(", text) and f.stem not in ("common", "status", "headline", "all"):
            assert f.stem in decl, f"{f.name} writes RESULTS sections but declares no SECTIONS / GPU_SECTIONS"
    for name, d in decl.items():
        assert d.get("MEASURES"), f"bench/{name}.py declares sections but no MEASURES"
        assert f"bench/{name}.py" in d["MEASURES"], f"bench/{name}.py: MEASURES should name the script itself"
        for path in d["MEASURES"]:
            assert (ROOT / path).exists(), f"bench/{name}.py: MEASURES names {path}, which does not exist"
        for key, args in d.get("SECTIONS", {}).items():
            assert isinstance(args, str) and "--write" in args, f"{name}: section {key} must run with --write"


def test_driver_runs_every_declared_cpu_section_once_in_order():
    decl = common.declared_scripts()
    assert set(bench_all.ORDER) <= set(decl), "bench.all.ORDER names a script that declares no sections"
    planned = [key for _, key, _ in bench_all.plan()]
    expected = [k for d in decl.values() for k in d.get("SECTIONS", {})]
    assert sorted(planned) == sorted(expected)
    scripts = list(dict.fromkeys(name for name, _, _ in bench_all.plan()))
    ordered = [n for n in scripts if n in bench_all.ORDER]
    assert ordered == [n for n in bench_all.ORDER if n in scripts]  # ORDER first, as listed
    assert scripts[:len(ordered)] == ordered                        # the rest after, by name


def _json_inputs(script: Path) -> set[str]:
    """The committed .json files a bench script names (by path or by file name) under bench/,
    bench/results, bench/profiles or jaxserve/profiles."""
    out = set()
    for lit in set(re.findall(r'"([A-Za-z0-9_./-]*\.json)"', script.read_text())):
        for d in ("", "bench", "bench/results", "bench/profiles", "jaxserve/profiles"):
            rel = lit if not d else f"{d}/{Path(lit).name}"
            if (ROOT / rel).is_file() and common.git("ls-files", "--", rel) == rel:
                out.add(rel)
    return out


def _covers(paths, f: str) -> bool:
    return any(f == p or f.startswith(p.rstrip("/") + "/") for p in paths)


def test_every_committed_input_a_script_reads_is_measured_or_produced_by_it():
    """A cost model or profile a section's numbers depend on is in its MEASURES, so rewriting it
    makes the section stale (arlo_short read sim_knee's cost model without declaring it: its
    table described a cost model two re-profiles old while bench.status called it fresh)."""
    decl = common.declared_scripts()
    assert any(_json_inputs(ROOT / "bench" / f"{n}.py") for n in decl)  # the scan finds inputs at all
    for name, d in decl.items():
        declared = (*d.get("MEASURES", ()), *d.get("PRODUCES", ()))
        for f in sorted(_json_inputs(ROOT / "bench" / f"{name}.py")):
            assert _covers(declared, f), f"bench/{name}.py reads {f} but neither MEASURES nor PRODUCES names it"


def test_bench_all_runs_each_producer_before_the_scripts_that_measure_its_output():
    decl = common.declared_scripts()
    first = {}
    for i, (name, _, _) in enumerate(bench_all.plan()):
        first.setdefault(name, i)
    pairs = 0
    for producer, d in decl.items():
        for f in d.get("PRODUCES", ()):
            assert (ROOT / f).is_file(), f"bench/{producer}.py PRODUCES {f}, which does not exist"
            for consumer, c in decl.items():
                if consumer != producer and consumer in first and _covers(c.get("MEASURES", ()), f):
                    pairs += 1
                    assert first[producer] < first[consumer], f"{consumer} reads {f} but runs before {producer}"
    assert pairs >= 3  # sim_knee's cost model, otas_profile's, workers' Ray hop: each has readers


def test_every_results_section_is_declared_and_gpu_titles_say_gpu():
    decl = status.declared()
    for s in status.parse_sections(RESULTS.read_text()):
        assert s.key in decl, f"RESULTS.md section {s.key!r} is declared by no script (nor status.EXTERNAL)"
        if decl[s.key]["gpu"]:
            assert "GPU" in s.title, f"GPU section {s.key!r}: its title should say GPU ({s.title!r})"


# ---------------------------------------------------------------- bench.all

def test_all_quick_dry_run_lists_every_cpu_section_and_no_gpu_one():
    r = _run(["-m", "bench.all", "--quick", "--dry-run"])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    decl = status.declared()
    cpu = [k for k, d in decl.items() if not d["gpu"] and d["script"].startswith("bench.")]
    gpu = [k for k, d in decl.items() if d["gpu"]]
    for key in cpu:
        assert f"] {key}: python -m bench." in out, f"{key} missing from the plan"
    for key in gpu:
        assert f"] {key}: " not in out, f"GPU section {key} must not be run by bench.all"
    runs = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert runs and all(ln.endswith("--quick") for ln in runs)
    assert "jaxserve-bench-quick" in out.splitlines()[0]  # quick goes elsewhere, never bench/RESULTS.md


def test_all_plan_only_and_skip():
    keys = [k for _, k, _ in bench_all.plan(only={"arlo_sim"})]
    assert keys == ["arlo_profile", "arlo_sim", "arlo_runtimes", "arlo_dispatch", "arlo_periodic"]
    keys = [k for _, k, _ in bench_all.plan(only={"arlo_sim"}, skip={"arlo_dispatch"})]
    assert "arlo_dispatch" not in keys and len(keys) == 4


# ---------------------------------------------------------------- quick runs and stamps

def test_quick_runs_write_only_to_their_directory(tmp_path, real_files_untouched):
    env = {"JAXSERVE_BENCH_OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    for args in (["-m", "bench.sim_speed", "--write", "--quick"], ["-m", "bench.arlo_solver", "--write", "--quick"]):
        r = _run(args, env=env, timeout=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    sections = {s.key: s for s in status.parse_sections((tmp_path / "RESULTS.md").read_text())}
    assert set(sections) == {"sim_speed", "arlo_solver"}
    for s in sections.values():
        assert s.quick
        assert set(s.fields) >= {"Commit", "Machine", "Versions", "Date", "Command"}
        assert "--quick" in s.fields["Command"] and s.fields["Command"].startswith("python -m bench.")
        assert "jaxlib" in s.fields["Versions"] and "cores" in s.fields["Machine"]


def test_a_quick_section_is_refused_for_the_real_results(real_files_untouched):
    text = f"<!-- bench:x -->\n## x\n\n{common.QUICK_MARK}\n\nbody\n<!-- /bench:x -->"
    with pytest.raises(ValueError, match="--quick"):
        common.splice(text, path=common.CANONICAL_RESULTS)


def test_splice_replaces_one_section_in_a_given_file(tmp_path):
    path = tmp_path / "R.md"
    common.splice("<!-- bench:a -->\n## A\n\none\n<!-- /bench:a -->", path)
    common.splice("<!-- bench:b -->\n## B\n\ntwo\n<!-- /bench:b -->", path)
    common.splice("<!-- bench:a -->\n## A\n\nthree\n<!-- /bench:a -->", path)
    text = path.read_text()
    assert "three" in text and "one" not in text and "two" in text
    assert [s.key for s in status.parse_sections(text)] == ["a", "b"]


def _run_section(commit: str, date: str, figure: int, extra: str = "") -> str:
    """A section as a script writes it (stamp, a table, a generated reading), plus ``extra``."""
    return (f"<!-- bench:a -->\n## A\n\n*Commit:* {commit}  \n*Machine:* AMD EPYC, 2 cores; cpu  \n"
            f"*Date:* {date}\n\n| x |\n|---|\n| {figure} |\n\nReading. the figure is {figure}.\n{extra}"
            f"<!-- /bench:a -->")


HAND = ("**Reading (hand-written, 2026-01-02).** Why the figure is what it is.\nA second line.\n\n"
        "- and a list that belongs to it\n")


def test_a_rerun_carries_the_hand_written_reading_over_marked_and_drops_the_waivers(tmp_path):
    path = tmp_path / "R.md"
    first = _run_section("a" * 40, "2026-01-01 10:00 UTC", 1,
                         "\n*Unaffected by:* bbbbbbb — a rename  \n\n" + HAND)
    common.splice(first, path)
    assert common.carried_reading(first, first) == ""        # the new text already holds it
    common.splice(_run_section("c" * 40, "2026-02-01 10:00 UTC", 2), path)
    text = path.read_text()
    (sec,) = status.parse_sections(text)
    assert "| 2 |" in text and "| 1 |" not in text and "the figure is 1" not in text
    assert "Unaffected by" not in text                        # the waiver vouched for the old stamp
    assert text.count(HAND.strip()) == 1
    carried = [ln for ln in text.splitlines() if ln.startswith(common.CARRIED_MARK)]
    assert len(carried) == 1 and "aaaaaaaaa (2026-01-01 10:00 UTC)" in carried[0]
    # after the new run's own text, the mark just above the reading, the section closed after it
    assert text.index("the figure is 2") < text.index(common.CARRIED_MARK) < text.index(HAND.strip())
    assert sec.text.rstrip().endswith(HAND.strip() + "\n<!-- /bench:a -->")
    # a third run: the reading is still the one written for the first run, carried once
    common.splice(_run_section("d" * 40, "2026-03-01 10:00 UTC", 3), path)
    text = path.read_text()
    assert text.count(HAND.strip()) == 1 and text.count(common.CARRIED_MARK) == 1
    assert "aaaaaaaaa (2026-01-01" in text and "ccccccccc" not in text and "| 3 |" in text
    # once checked (the mark deleted by hand), the next rerun marks it again, for that run
    path.write_text("\n".join(ln for ln in text.splitlines() if not ln.startswith(common.CARRIED_MARK)))
    common.splice(_run_section("e" * 40, "2026-04-01 10:00 UTC", 4), path)
    text = path.read_text()
    assert text.count(common.CARRIED_MARK) == 1 and "ddddddddd (2026-03-01" in text


def test_a_rerun_of_a_section_without_a_hand_written_reading_is_the_new_text_alone(tmp_path):
    path = tmp_path / "R.md"
    common.splice(_run_section("a" * 40, "2026-01-01 10:00 UTC", 1, "\nReading: generated too.\n"), path)
    new = _run_section("c" * 40, "2026-02-01 10:00 UTC", 2)
    common.splice(new, path)
    (sec,) = status.parse_sections(path.read_text())
    assert sec.text == new


@needs_git
def test_status_names_a_carried_reading_for_review_and_strict_check_fails_on_it(tmp_path, capsys):
    path = tmp_path / "RESULTS.md"
    head = common.git("rev-parse", "HEAD")
    path.write_text(_section("sim_speed", head))
    assert status.main(["--results", str(path), "--check", "--strict"]) == 0
    common.splice(_section("sim_speed", head).replace("| 1 |", "| 1 |\n\n" + HAND), path)
    common.splice(_section("sim_speed", head).replace("| 1 |", "| 2 |"), path)
    (row,) = status.status(path)
    assert row.state == "fresh" and row.review.startswith(common.CARRIED_MARK)
    capsys.readouterr()
    assert status.main(["--results", str(path), "--check"]) == 0     # the numbers are current
    out = capsys.readouterr().out
    assert re.search(r"to check against the new numbers.*: sim_speed$", out, re.M)
    assert status.main(["--results", str(path), "--check", "--strict"]) == 1


# ---------------------------------------------------------------- bench.status

def _section(key: str, commit: str | None, title: str = "T") -> str:
    stamp = (f"*Commit:* {commit}  \n" if commit else "") + "*Machine:* AMD EPYC, 2 cores; cpu  \n*Date:* 2026-01-01 00:00 UTC"
    return f"<!-- bench:{key} -->\n## {title}\n\n{stamp}\n\n| a |\n|---|\n| 1 |\n<!-- /bench:{key} -->\n"


@needs_git
def test_status_fresh_stale_unstamped_unknown_undeclared(tmp_path, real_files_untouched):
    head = common.git("rev-parse", "HEAD")
    last = common.git("log", "-1", "--format=%H", "--", *status.declared()["sim_speed"]["measures"])
    before = common.git("rev-parse", f"{last}^")
    if not before:
        pytest.skip("the measured files' last change is the root commit")
    path = tmp_path / "RESULTS.md"
    path.write_text("# r\n\n" + "\n".join([
        _section("sim_speed", head),                                    # fresh: HEAD holds every change
        _section("arlo_solver", None),                                  # unstamped
        _section("tuning", "0123456789abcdef0123456789abcdef01234567"),  # unknown commit
        _section("nosuch", head),                                       # undeclared
        _section("otas-utility-sim", head + " +uncommitted"),           # stale: measured uncommitted edits
    ]))
    rows = {r.key: r for r in status.status(path)}
    assert rows["sim_speed"].state == "fresh"
    assert rows["arlo_solver"].state == "unstamped"
    assert rows["tuning"].state == "unknown"
    assert rows["nosuch"].state == "undeclared"
    assert rows["otas-utility-sim"].state == "stale"
    assert status.main(["--results", str(path)]) == 0
    assert status.main(["--results", str(path), "--check"]) == 1
    assert status.main(["--results", str(path), "--check", "--strict"]) == 1


@needs_git
def test_status_stale_names_the_changed_files(tmp_path):
    measures = status.declared()["sim_speed"]["measures"]
    last = common.git("log", "-1", "--format=%H", "--", *measures)
    before = common.git("rev-parse", f"{last}^")
    if not before:
        pytest.skip("the measured files' last change is the root commit")
    path = tmp_path / "RESULTS.md"
    path.write_text(_section("sim_speed", before))
    (row,) = status.status(path)
    assert row.state == "stale" and row.stamped == before[:9]
    changed = common.git("diff", "--name-only", before, "HEAD", "--", *measures).split()
    assert changed and changed[0] in row.detail
    assert status.main(["--results", str(path), "--check"]) == 1
    path.write_text(_section("sim_speed", common.git("rev-parse", "HEAD")))
    assert status.main(["--results", str(path), "--check"]) == 0


@needs_git
def test_a_waiver_naming_every_later_commit_keeps_a_section_fresh_and_any_other_commit_does_not(tmp_path):
    measures = status.declared()["sim_speed"]["measures"]
    last = common.git("log", "-1", "--format=%H", "--", *measures)
    before = common.git("rev-parse", f"{last}^")
    if not before or common.git("log", "--format=%H", f"{before}..HEAD", "--", *measures).split() != [last]:
        pytest.skip("needs exactly one change to the measured files after the stamp")
    path = tmp_path / "RESULTS.md"
    waived = _section("sim_speed", before).replace("| a |", f"*Unaffected by:* {last[:9]} — a rename\n\n| a |")
    path.write_text(waived)
    (row,) = status.status(path)
    assert row.state == "fresh" and last[:9] in row.detail and "waived" in row.detail
    path.write_text(waived.replace(last[:9], before[:9]))  # a waiver for another commit waives nothing
    (row,) = status.status(path)
    assert row.state == "stale"


# ---------------------------------------------------------------- bench.headline

def test_headline_from_the_real_results_finds_every_figure():
    table, problems = headline.build(RESULTS)
    assert problems == []
    lines = table.splitlines()
    assert len(lines) == 2 + len(headline.ROWS)
    for row, line in zip(headline.ROWS, lines[2:]):
        for key in row.sources:
            assert f"`{key}` (" in line, f"{row.question}: the source column should name {key}"


def test_headline_write_rewrites_only_between_the_markers(tmp_path, real_files_untouched):
    results, readme = tmp_path / "RESULTS.md", tmp_path / "README.md"
    shutil.copy(RESULTS, results)
    original = README.read_text()
    assert headline.BEGIN in original and headline.END in original, "README.md lost its headline markers"
    readme.write_text(original.replace(headline.BEGIN + "\n", headline.BEGIN + "\n| old | table |\n", 1))
    assert headline.main(["--results", str(results), "--readme", str(readme), "--write"]) == 0
    new = readme.read_text()
    head, tail = original.split(headline.BEGIN)[0], original.split(headline.END)[1]
    assert new.startswith(head) and new.endswith(tail) and "| old | table |" not in new
    body = new.split(headline.BEGIN)[1].split(headline.END)[0]
    assert body.count("\n|") == 2 + len(headline.ROWS)


def test_headline_marks_stale_figures_and_reports_missing_ones(tmp_path):
    if not common.git("rev-parse", "HEAD"):
        pytest.skip("not a git checkout")
    measures = status.declared()["sim_speed"]["measures"]
    last = common.git("log", "-1", "--format=%H", "--", *measures)
    before = common.git("rev-parse", f"{last}^")
    text = RESULTS.read_text()
    sections = {s.key: s for s in status.parse_sections(text)}
    old = sections["sim_speed"].text
    if "*Commit:* " in old:  # stamped: back-date its commit to before the last change of what it measures
        stamped = re.sub(r"\*Commit:\* [0-9a-f]+", f"*Commit:* {before}", old, count=1)
    else:
        stamped = old.replace("## Simulator speed\n\n", f"## Simulator speed\n\n*Commit:* {before}  \n", 1)
    stamped = re.sub(r"^\*Unaffected by:\*.*\n", "", stamped, flags=re.M)  # and no waiver keeps it fresh
    assert stamped != old
    text = text.replace(old, stamped)
    text = text.replace(sections["coldstart"].text, "")  # a figure's section gone
    results = tmp_path / "RESULTS.md"
    results.write_text(text)
    table, problems = headline.build(results)
    speed = next(ln for ln in table.splitlines() if ln.startswith("| simulator speed"))
    assert "**stale**" in speed
    assert any("coldstart" in p for p in problems)
    assert "not found" in next(ln for ln in table.splitlines() if ln.startswith("| serialized executables"))


def test_splice_readme_refuses_a_readme_without_markers():
    with pytest.raises(ValueError, match="markers"):
        headline.splice_readme("# no table here\n", "| a |")


def test_headline_reads_a_run_cut_short_as_partial(tmp_path):
    """A GPU run stopped by the host's time limit keeps the models it finished: the headline
    names the missing one '—' and says the run stopped, rather than failing or reading it as whole."""
    text = RESULTS.read_text()
    old = {s.key: s for s in status.parse_sections(text)}["polymorph_gpu"].text
    whole = re.sub(r"\s*\*\*Partial:\*\*[^\n]*", "", old)
    cut = "\n".join(ln for ln in whole.splitlines() if not ln.startswith("| minilm-l6 |"))
    cut = cut.replace("warmup's tuning off.", "warmup's tuning off.  \n**Partial:** 1 of 2 models (bert-base, "
                      "minilm-l6) measured (the run stopped).", 1)
    assert "**Partial:** 1 of 2 models" in cut
    rows = {}
    for name, section in (("whole", whole), ("cut", cut)):
        results = tmp_path / f"{name}.md"
        results.write_text(text.replace(old, section))
        table, problems = headline.build(results)
        assert problems == []
        rows[name] = next(ln for ln in table.splitlines() if ln.startswith("| polymorph buckets vs pad-to-512, GPU"))
    assert re.search(r"\| [\d.]+× / — ST's tokens/s \(1 of 2 models: the run stopped\) \|", rows["cut"])
    assert "the run stopped" not in rows["whole"]


def _headline_row(tmp_path, text: str, replace: dict[str, str], starts: str) -> str:
    """The headline row starting with ``starts``, built from ``text`` with sections replaced."""
    for old, new in replace.items():
        text = text.replace(old, new)
    results = tmp_path / "RESULTS.md"
    results.write_text(text)
    table, problems = headline.build(results)
    assert problems == []
    return next(ln for ln in table.splitlines() if ln.startswith(starts))


def test_headline_compares_warmups_only_between_whole_runs_on_one_machine(tmp_path):
    """The TF32 row quotes the strict-fp32 run's warmup beside its own only when both covered the
    whole grid on the same machine (the brief: never mix machines in one comparison)."""
    text = RESULTS.read_text()
    sections = {s.key: s for s in status.parse_sections(text)}
    tf32, strict = sections["peer_gpu_tf32"].text, sections["peer_gpu"].text
    whole = lambda sec: re.sub(r"\s*\*\*Partial:\*\*[^\n]*", "", sec)  # noqa: E731
    on = lambda sec, gpu: re.sub(r"NVIDIA H\d00[^;\n ]*( 80GB HBM3)?", gpu, sec)  # noqa: E731

    def row(tf32_text, strict_text):
        return _headline_row(tmp_path, text, {tf32: tf32_text, strict: strict_text}, "| the same with TF32")

    assert "(strict fp32:" in row(on(whole(tf32), "NVIDIA H200"), on(whole(strict), "NVIDIA H200"))
    assert "(strict fp32:" not in row(on(whole(tf32), "NVIDIA H200"), on(whole(strict), "NVIDIA H100 80GB HBM3"))
    cut = on(whole(tf32), "NVIDIA H200").replace(
        "Geometric means", "**Partial:** 3 of 16 cells (x) measured.  \nGeometric means", 1)
    assert "(strict fp32:" not in row(cut, on(whole(strict), "NVIDIA H200"))


def test_headline_sets_bf16_against_float32_load_only_within_one_run(tmp_path):
    text = RESULTS.read_text()
    sections = {s.key: s for s in status.parse_sections(text)}
    f32, bf16 = sections["load"].text, sections["load_bf16"].text
    stamp = lambda sec, machine, date: re.sub(r"\*Date:\* [^\n]*", f"*Date:* {date}",  # noqa: E731
                                              re.sub(r"\*Machine:\* [^\n]*", f"*Machine:* {machine}  ", sec, count=1),
                                              count=1)

    def row(f32_text, bf16_text):
        return _headline_row(tmp_path, text, {f32: f32_text, bf16: bf16_text}, "| the same with `--precision bf16`")

    epyc, xeon = "AMD EPYC, 2 cores; cpu", "Intel Xeon, 2 cores; cpu"
    same = row(stamp(f32, epyc, "2026-01-01 10:00 UTC"), stamp(bf16, epyc, "2026-01-01 10:20 UTC"))
    assert "ours in bf16 is" in same and "× ours in float32" in same
    for machine, date in ((xeon, "2026-01-01 10:20 UTC"), (epyc, "2026-01-02 10:20 UTC")):
        other = row(stamp(f32, epyc, "2026-01-01 10:00 UTC"), stamp(bf16, machine, date))
        assert "ours in bf16 is" not in other and "is another run" in other


def test_headline_reads_no_figure_out_of_a_carried_reading(tmp_path):
    path = tmp_path / "R.md"
    common.splice(_run_section("a" * 40, "2026-01-01 10:00 UTC", 1, "\n" + HAND.replace("Why", "Speed-up 9.9x, why")), path)
    common.splice(_run_section("c" * 40, "2026-02-01 10:00 UTC", 2), path)
    (sec,) = status.parse_sections(path.read_text())
    assert "Speed-up 9.9x" in sec.text                     # carried, for a reader
    seen = headline.Sec(sec)
    assert seen.rx(r"the figure is (\d)").group(1) == "2"
    with pytest.raises(headline.NotFound):
        seen.rx(r"Speed-up ([\d.]+)x")
    assert [r["x"] for r in seen.table("x")] == ["2"]


# ------------------------------------------------ inputs an earlier run of the same make bench wrote

def test_a_stamp_lists_the_uncommitted_contents_it_measured():
    path = ROOT / "compiled_cache" / "README.md"
    if common.git("ls-files", "--", "compiled_cache/README.md") != "compiled_cache/README.md":
        pytest.skip("compiled_cache/README.md is not tracked here")
    before = path.read_bytes()
    try:
        assert "*Uncommitted:*" not in common.stamp(measures=("compiled_cache/README.md",))
        path.write_bytes(before + b"\nan input a run wrote\n")
        blob = common.git("hash-object", "--", "compiled_cache/README.md")
        text = common.stamp(measures=("compiled_cache/README.md",))
    finally:
        path.write_bytes(before)
    (sec,) = status.parse_sections(f"<!-- bench:k -->\n## K\n\n{text}\n<!-- /bench:k -->")
    assert sec.uncommitted and sec.measured_blobs == {"compiled_cache/README.md": blob}
    assert len(blob) == 40 and blob != common.git("rev-parse", "HEAD:compiled_cache/README.md")


@needs_git
def test_a_stamp_counts_a_measured_file_no_commit_holds_yet():
    """An output an earlier script of the same run wrote and no commit holds yet (fidelity's
    calibration file was new when sim_knee read it, and its stamps said nothing) makes the stamp
    +uncommitted and is listed with its contents; an untracked file outside the measures is not."""
    rel = "bench/results/_stamp_probe_untracked.json"
    path = ROOT / rel
    assert not path.exists()
    try:
        path.write_text('{"probe": 1}\n')
        text = common.stamp(measures=(rel,))
        assert "+uncommitted" in text
        assert f"*Uncommitted:* {rel}@{common.git('hash-object', '--', rel)}" in text
        assert rel not in common.uncommitted_blobs(("bench/status.py",))
    finally:
        path.unlink()
    assert rel not in common.stamp(measures=(rel,))


def _input_history():
    """A tracked file ``f`` with an earlier commit, its last change ``last``, the commit before it
    ``x``, and another file ``g`` changed after ``x`` by commits that never touch ``f``: the first
    such pair among the files benchmarks produce and files that change often (a rerun that rewrites
    one input must not leave the test without a pair)."""
    inputs = sorted({f for d in common.declared_scripts().values() for f in d.get("PRODUCES", ())})
    for f in inputs:
        last = common.git("log", "-1", "--format=%H", "--", f)
        x = common.git("rev-parse", f"{last}^") if last else ""
        if not x:
            continue
        for g in ("bench/status.py", "bench/headline.py", "bench/common.py", "bench/all.py", "README.md"):
            others = common.git("log", "--format=%H", f"{x}..HEAD", "--", g).split()
            if others and not any(f in common.git("show", "--name-only", "--format=", c).split() for c in others):
                return f, last, x, g, others
    pytest.skip("no produced file with an earlier commit and a later change to another file (a shallow clone?)")


@needs_git
def test_status_judges_a_run_on_uncommitted_inputs_by_the_commit_that_committed_them(tmp_path, monkeypatch):
    f, last, x, g, others = _input_history()
    blob = common.git("rev-parse", f"HEAD:{f}")

    def judged(measures, uncommitted: str | None, waive: list[str] = ()) -> status.Status:
        monkeypatch.setattr(status, "declared", lambda: {"k": {"script": "bench.k", "measures": measures,
                                                                  "gpu": False, "args": ""}})
        stamp = f"*Commit:* {x}" + (" +uncommitted  \n" if uncommitted is not None else "  \n")
        if uncommitted:
            stamp += f"*Uncommitted:* {uncommitted}  \n"
        stamp += "*Date:* 2026-01-01 00:00 UTC\n\n" + "".join(f"*Unaffected by:* {c[:9]} — why  \n" for c in waive)
        path = tmp_path / "R.md"
        path.write_text(f"<!-- bench:k -->\n## K\n\n{stamp}\n| a |\n|---|\n| 1 |\n<!-- /bench:k -->\n")
        (row,) = status.status(path)
        return row

    # the run read f as HEAD now holds it, written before `last` committed it: fresh
    row = judged((f,), f"{f}@{blob}")
    assert row.state == "fresh" and last[:9] in row.detail and f in row.detail
    # without the input's contents listed, or with other contents, it is stale
    assert judged((f,), "").state == "stale"
    row = judged((f,), f"{f}@{'0' * 40}")
    assert row.state == "stale" and "holds otherwise" in row.detail
    assert judged((f,), None).state == "stale"                    # a clean run at x: f changed since
    # another measured file changed after x: stale, naming it, unless those commits are waived
    row = judged((f, g), f"{f}@{blob}")
    assert row.state == "stale" and g in row.detail and f not in row.detail.split(";")[0]
    row = judged((f, g), f"{f}@{blob}", waive=others)
    assert row.state == "fresh" and "waived" in row.detail


def test_the_cpu_knee_row_gives_a_range_where_the_on_time_share_dips_below_the_knee(tmp_path):
    """The knee's rule takes the highest rate at >= 99% on time; where the share first fell below 99%
    at a lower rate, the row gives the ratio as a range from the last rate before that dip (a headline
    states what the reading admits), and one figure where no rate below the knee misses."""
    text = RESULTS.read_text()
    load = {s.key: s for s in status.parse_sections(text)}["load"].text
    knee = float(re.search(r"^jaxserve, 2 workers \(poisson\): [\d.]+/s \(offered (\d+)/s", load, re.M).group(1))
    peer = float(re.search(r"^naive FastAPI[^:]*: ([\d.]+)/s", load, re.M).group(1))
    row_re = re.compile(r"^\| jaxserve, 2 workers \| poisson \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                        r"([\d.]+) \| ([\d.]+) \|", re.M)
    below = [m for m in row_re.finditer(load) if float(m.group(1)) < knee]
    assert len(below) >= 2, "the load section needs two 2-worker rates below the knee"

    def with_rows(att_of):  # every 2-worker poisson row below the knee: p98 within the SLO, attainment att_of(i)
        out, i = load, 0
        for m in below:
            new = (f"| jaxserve, 2 workers | poisson | {m.group(1)} | {m.group(2)} | {m.group(3)} | 100.0 | "
                   f"{m.group(5)} | {att_of(i):.3f} |")
            out, i = out.replace(m.group(0), new, 1), i + 1
        return out

    def two_workers(section):
        row = _headline_row(tmp_path, text, {load: section}, "| the same on the 2-core CPU")
        return row.split(" (two, the default)")[0].split(" / ")[-1]

    ours = float(re.search(r"^jaxserve, 2 workers \(poisson\): ([\d.]+)/s", load, re.M).group(1))
    high = f"{ours / peer:.1f}"
    assert two_workers(with_rows(lambda i: 1.0)) == f"{high}×"
    dip = len(below) - 1  # the last rate below the knee misses: the range starts at the one before it
    low = f"{float(below[dip - 1].group(2)) / peer:.1f}"
    expected = f"{high}×" if low == high else f"{low}–{high}×"
    assert two_workers(with_rows(lambda i: 0.95 if i == dip else 1.0)) == expected
    assert two_workers(with_rows(lambda i: 0.95 if i == 0 else 1.0)) == f"{high}×"  # nothing passes before: no bound


def test_the_cpu_knee_goal_divides_the_simulated_ceiling_by_the_peers_live_knee(tmp_path):
    """The goal column's ceiling ratio is sim_knee's ceiling (answered/s) over the naive peer's knee in
    the load section, worked here from both sections' text; and it says when they are two days' runs."""
    text = RESULTS.read_text()
    secs = {s.key: s for s in status.parse_sections(text)}
    knee, load = secs["sim_knee"].text, secs["load"].text
    peer = float(re.search(r"^naive FastAPI[^:]*: ([\d.]+)/s", load, re.M).group(1))
    old = re.search(r"Ceiling: \*\*[\d,.]+ answered/s\*\*", knee).group(0)
    ceiling = round(peer * 2.46)  # a ceiling worked to give a known ratio
    date = re.search(r"^\*Date:\* (.*?)\s*$", load, re.M).group(1)
    same_day = re.sub(r"^\*Date:\* .*$", f"*Date:* {date}  ", knee, count=1, flags=re.M)
    edited = same_day.replace(old, f"Ceiling: **{ceiling} answered/s**")
    row = _headline_row(tmp_path, text, {knee: edited}, "| the same on the 2-core CPU")
    assert f"ceiling ~{ceiling / peer:.1f}× by the calibrated simulator: {ceiling} answered/s over the peer's " \
           f"{peer:.0f}/s, see below" in row
    other_day = edited.replace(f"*Date:* {date}", "*Date:* 2001-01-01 00:00 UTC", 1)
    row = _headline_row(tmp_path, text, {knee: other_day}, "| the same on the 2-core CPU")
    assert f"{peer:.0f}/s; 2001-01-01 against {date[:10]}, see below" in row


def test_sim_knee_reads_the_two_worker_slowdown_from_the_workers_section(tmp_path):
    """Two workers' p50 per batch over one worker's, at batch 8, from the section's own rows; a
    RESULTS without the section is refused with the flag that overrides it."""
    from bench.sim_knee import shared_slowdown

    sec = ("<!-- bench:workers -->\n## Executor workers\n\n*Date:* 2030-01-02 03:04 UTC  \n\n"
           "| batch | configuration | sentences/s | × 1 worker | p50 ms/batch | p98 ms/batch |\n|---|---|---|---|---|---|\n"
           "| 1 | 1 worker, XLA threads = cores | 100 | 1.00 | 9.0 | 12.0 |\n"
           "| 1 | 2 workers, XLA threads = cores | 110 | 1.10 | 16.0 | 25.0 |\n"
           "| 8 | 1 worker, XLA threads = cores | 230 | 1.00 | 40.0 | 42.0 |\n"
           "| 8 | 2 workers, XLA threads = cores | 227 | 0.98 | 70.0 | 115.0 |\n\n<!-- /bench:workers -->\n")
    results = tmp_path / "RESULTS.md"
    results.write_text(sec)
    ratio, where = shared_slowdown(results)
    assert ratio == pytest.approx(70.0 / 40.0)
    assert "2030-01-02" in where and "70.0 ms" in where and "40.0 ms" in where
    results.write_text(sec.replace("bench:workers", "bench:other"))
    with pytest.raises(ValueError, match="--shared"):
        shared_slowdown(results)
