"""Shared by the benchmarks: markdown tables and recording them in bench/RESULTS.md.

Each benchmark owns one or more sections of RESULTS.md, delimited by HTML comments, and
rewrites only its own, stamped by :func:`stamp` (the one place stamps are made): the commit,
the machine (CPU model, cores, platform), the jax and jaxlib versions, the date (UTC) and the
exact command.

Each script declares, at module level and as literals (read with ``ast`` by
:func:`declarations`, never by importing the script):

- ``MEASURES``: the repository paths whose code its numbers measure (the script itself, the
  jaxserve modules it exercises); ``python -m bench.status`` calls a section stale when one of
  them changed in a commit the section's stamped commit does not contain;
- ``SECTIONS``: ``{key: "arguments"}``, the CPU sections it writes and the arguments of the
  run that writes each (``python -m bench.all`` runs them: ``make bench``);
- optionally ``GPU_SECTIONS``: the same for sections measured on a GPU host (never run by
  ``bench.all``; they keep their own stamp, and their titles say "GPU");
- optionally ``PRODUCES``: the committed files its runs write (a cost model or a profile that
  other runs read, raw results). ``bench.all`` runs a producer before every script whose ``MEASURES``
  names one of them, and a consumer's stamp lists the uncommitted contents it read
  (:func:`stamp`), so one run of them all leaves nothing stale once its outputs are committed.

Quick runs (``--quick``: the same code path on tiny sizes, a smoke test) never touch the real
RESULTS.md: when the command line holds ``--quick`` every output of this module (RESULTS,
plots, :func:`output`) goes to a scratch directory (``$JAXSERVE_BENCH_OUT``, default
``$TMPDIR/jaxserve-bench-quick``), and :func:`splice` refuses a quick section into
bench/RESULTS.md whatever the paths say.
"""

from __future__ import annotations

import ast
import datetime as _dt
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
CANONICAL_RESULTS = BENCH / "RESULTS.md"
QUICK_MARK = "*Quick run: smoke numbers on tiny sizes, not results.*"


def _quick_argv(argv: list[str] | None = None) -> bool:
    return "--quick" in (sys.argv[1:] if argv is None else argv)


def out_dir() -> Path | None:
    """Where this process's outputs go instead of bench/: ``$JAXSERVE_BENCH_OUT`` if set, a
    scratch directory for a ``--quick`` run, else None (the real files)."""
    env = os.environ.get("JAXSERVE_BENCH_OUT")
    if env:
        return Path(env)
    if _quick_argv():
        return Path(tempfile.gettempdir()) / "jaxserve-bench-quick"
    return None


_OUT = out_dir()
RESULTS = (_OUT / "RESULTS.md") if _OUT else CANONICAL_RESULTS
PLOTS = (_OUT / "plots") if _OUT else BENCH / "plots"


def output(path: str | Path) -> Path:
    """A side output of a benchmark (a cost model, a report) at ``path``, or under the scratch
    directory (same name) when this run's outputs are redirected (see :func:`out_dir`)."""
    out = out_dir()
    if out is None:
        return Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out / Path(path).name


def shown_path(path: str | Path) -> str:
    """``path`` as a section names it: relative to the repository where it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT.resolve()))
    except ValueError:
        return str(path)


def add_quick(ap, **small) -> None:
    """Give ``ap`` a ``--quick`` flag; :func:`apply_quick` then sets ``small``'s values on the
    parsed arguments (overriding the command line's): the same code path with less work."""
    shown = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in small.items() if v is not True)
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run on tiny sizes ({shown or 'fewer repeats'}); writes under $JAXSERVE_BENCH_OUT "
                         "or a scratch directory, never bench/RESULTS.md")
    ap.set_defaults(_quick_small=small)


def apply_quick(args):
    """``args`` with the quick sizes of :func:`add_quick` applied when ``--quick`` was given."""
    if getattr(args, "quick", False):
        for k, v in getattr(args, "_quick_small", {}).items():
            setattr(args, k, v)
    return args


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def machine() -> str:
    """CPU model and cores, the platform, and the device kind when it is not the CPU."""
    from jaxserve.profiler import machine_description

    import jax

    dev = jax.devices()[0]
    kind = "" if dev.platform == "cpu" else f"; {dev.device_kind}"
    return f"{machine_description()}; {dev.platform}{kind}"


def versions() -> str:
    import jax
    import jaxlib

    return f"jax {jax.__version__}, jaxlib {getattr(jaxlib, '__version__', '?')}"


def git(*args: str, cwd: Path = ROOT) -> str:
    """A git command's stdout (stripped) in the repository, or '' if git fails."""
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def commit_stamp(measures: tuple[str, ...] | list[str] = ()) -> str:
    """HEAD's hash, with ``+uncommitted`` when any of ``measures`` (or, with none given, any
    tracked file) differs from HEAD in the working tree: the numbers then measure code no
    commit holds. ``$JAXSERVE_BENCH_COMMIT``, when set, wins: the commit a sender checked out clean
    and copied to a GPU host, whose copy's git may name another (the lent device's did: an
    older HEAD under the newer tree). "unknown" without either."""
    sent = os.environ.get("JAXSERVE_BENCH_COMMIT")
    if sent:
        return sent
    head = git("rev-parse", "HEAD")
    if not head:
        return "unknown"
    # a measured file no commit holds yet (an output an earlier script of the same run wrote, say)
    # counts; with no measures named, untracked scratch files do not
    dirty = git("status", "--porcelain", "--untracked-files=all", "--", *measures) if measures else \
        git("status", "--porcelain", "--untracked-files=no")
    return head + (" +uncommitted" if dirty else "")


def uncommitted_blobs(measures: tuple[str, ...] | list[str] = ()) -> dict[str, str]:
    """``{path: git blob hash}`` of each of ``measures``' files that differs from HEAD in the working
    tree ("-" for one deleted), untracked ones included: what a ``+uncommitted`` run measured. Mostly the
    inputs an earlier run of the same ``make bench`` wrote (a cost model, a profile) before they
    were committed; ``python -m bench.status`` calls the section fresh once a commit holds exactly
    these contents (:func:`stamp`'s ``*Uncommitted:*`` line). {} outside git or when
    ``$JAXSERVE_BENCH_COMMIT`` names the commit."""
    if os.environ.get("JAXSERVE_BENCH_COMMIT") or not git("rev-parse", "HEAD"):
        return {}
    names = git("diff", "--name-only", "HEAD", "--", *measures) if measures else git("diff", "--name-only", "HEAD")
    if measures:  # and each measured file no commit holds yet (git ignores what .gitignore names)
        names += "\n" + git("ls-files", "--others", "--exclude-standard", "--", *measures)
    out = {}
    for name in filter(None, names.splitlines()):
        path = ROOT / name
        out[name] = git("hash-object", "--", name) if path.exists() else "-"
    return out


def invocation() -> list[str]:
    """argv as a user would retype it from the repository root: ``-m bench.x`` for a script here."""
    script = Path(sys.argv[0]).resolve()
    if script.parent == Path(__file__).resolve().parent and script.suffix == ".py":
        return ["-m", f"bench.{script.stem}", *sys.argv[1:]]
    return sys.argv


def command() -> str:
    return "python " + " ".join(shlex.quote(a) for a in invocation())


def _script_measures() -> tuple[str, ...]:
    script = Path(sys.argv[0]).resolve()
    if script.parent == BENCH and script.suffix == ".py":
        return tuple(declarations(script).get("MEASURES", ()))
    return ()


def stamp(machine_text: str | None = None, command_text: str | None = None,
          measures: tuple[str, ...] | None = None) -> str:
    """The stamp every RESULTS.md section carries, as markdown lines: commit (of the files the
    running script declares in ``MEASURES``; with ``*Uncommitted:* path@blob, ...`` after it when
    some of them differ from HEAD: :func:`uncommitted_blobs`), machine, jax/jaxlib versions, date
    (UTC) and the exact command; plus :data:`QUICK_MARK` on a ``--quick`` run."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    measures = _script_measures() if measures is None else measures
    lines = [f"*Commit:* {commit_stamp(measures)}"]
    dirty = uncommitted_blobs(measures) if lines[0].endswith("+uncommitted") else {}
    if dirty:
        lines.append("*Uncommitted:* " + ", ".join(f"{p}@{h}" for p, h in sorted(dirty.items())))
    lines += [f"*Machine:* {machine_text or machine()}",
             f"*Versions:* {versions()}",
             f"*Date:* {date}",
             f"*Command:* `{command_text or command()}`"]
    if _quick_argv():
        lines.append(QUICK_MARK)
    return "  \n".join(lines)


def section(key: str, title: str, body: str, notes: str = "", machine_text: str | None = None) -> str:
    """One RESULTS.md section, stamped by :func:`stamp`."""
    return (f"<!-- bench:{key} -->\n## {title}\n\n{stamp(machine_text)}\n\n"
            f"{body}\n\n{notes}\n<!-- /bench:{key} -->")


def record(key: str, title: str, body: str, notes: str = "") -> None:
    """Replace (or append) the ``key`` section of bench/RESULTS.md."""
    splice(section(key, title, body, notes))


# A hand-written reading: a paragraph that starts with READING_MARK, after the generated text,
# running to the section's end (what a session appends after a run).
READING_MARK = "**Reading (hand-written"
# The line that heads a hand-written reading a rerun carried over (see carried_reading).
CARRIED_MARK = "*Carried over:*"


def carried_reading(old_section: str, new_section: str) -> str:
    """What of ``old_section``'s hand-written reading a rerun's ``new_section`` must carry; ''
    when there is none, or when ``new_section`` already holds it.

    The reading is the section's tail from its first ``**Reading (hand-written`` paragraph (or
    the ``*Carried over:*`` line heading it) to the closing marker. It was written about the old
    run's numbers, so it goes over under a ``*Carried over:*`` line naming that run's commit and
    date; ``python -m bench.status`` lists such sections for review, and ``bench.headline`` reads
    no figure out of a carried reading. A reading carried before keeps its first line (it names
    the run the reading was written for, not the run it was last carried from). The old
    section's ``*Unaffected by:*`` waivers are not carried: they vouched for the old stamp."""
    body = old_section.rsplit("<!-- /bench:", 1)[0].rstrip().splitlines()
    start = next((i for i, ln in enumerate(body) if ln.startswith(READING_MARK)), None)
    if start is None:
        return ""
    head = start
    for i in range(start - 1, -1, -1):  # a carried-over line above it, blank lines between
        if body[i].startswith(CARRIED_MARK):
            head = i
            break
        if body[i].strip():
            break
    reading = "\n".join(body[start:]).strip()
    if reading in new_section:
        return ""
    if head < start:
        note = "\n".join(body[head:start]).strip()
    else:
        fields = {}
        for ln in body[:16]:
            if ln.startswith(("*Commit:* ", "*Date:* ")):
                name, value = ln.split(":* ", 1)
                fields[name[1:]] = value.strip()
        run = " ".join(x for x in (fields.get("Commit", "").split(" ")[0][:9],
                                   f"({fields['Date']})" if "Date" in fields else "") if x) or "without a stamp"
        note = (f"{CARRIED_MARK} the reading below was written for the run stamped {run}, not for the "
                f"numbers above: check it against them, then delete this line.  ")
    return f"{note}\n\n{reading}"


def splice(section_text: str, path: Path | None = None) -> Path:
    """Put a section made by :func:`section` (here or on another machine) into RESULTS.md
    (``path``, default this run's :data:`RESULTS`), replacing the one with the same key; the
    file written. The old section's hand-written reading goes over to the new one, marked for
    review (:func:`carried_reading`). A quick run's section is refused (ValueError) for
    bench/RESULTS.md."""
    path = Path(path or RESULTS)
    key = section_text.split("<!-- bench:", 1)[1].split(" -->", 1)[0]
    if QUICK_MARK in section_text and path.resolve() == CANONICAL_RESULTS.resolve():
        raise ValueError(f"section {key!r} comes from a --quick run: not written into {CANONICAL_RESULTS}")
    new = section_text.strip()
    text = path.read_text() if path.exists() else "# Benchmark results\n\nEach section is rewritten by the script named in it.\n"
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        old, tail = rest.split(end, 1)
        carry = carried_reading(start + old + end, new)
        if carry:
            new = new.rsplit(end, 1)[0].rstrip() + "\n\n" + carry + "\n" + end
        text = head + new + tail
    else:
        text = text.rstrip() + "\n\n" + new + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def declarations(script: str | Path) -> dict:
    """A bench script's module-level literal declarations (``MEASURES``, ``SECTIONS``,
    ``GPU_SECTIONS``), read with ``ast`` without importing it; {} for names it lacks.
    ValueError if one of them is not a literal."""
    tree = ast.parse(Path(script).read_text(), filename=str(script))
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in ("MEASURES", "SECTIONS", "GPU_SECTIONS", "PRODUCES"):
                    try:
                        out[t.id] = ast.literal_eval(node.value)
                    except ValueError as exc:
                        raise ValueError(f"{script}: {t.id} must be a literal") from exc
    return out


def declared_scripts(bench_dir: Path = BENCH) -> dict[str, dict]:
    """``{module name: declarations}`` for every bench script that declares sections."""
    out = {}
    for f in sorted(bench_dir.glob("*.py")):
        d = declarations(f)
        if d.get("SECTIONS") or d.get("GPU_SECTIONS"):
            out[f.stem] = d
    return out


def scrape(url: str, *prefixes: str) -> dict[str, float]:
    """A server's ``/metrics`` series (``name{labels}`` -> value) whose line starts with any
    of ``prefixes``."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(prefixes):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class MetricsSampler:
    """A server's ``/metrics`` series starting with any of ``prefixes`` (:func:`scrape`), every
    ``every`` seconds on a background thread while used as a context manager: ``rows`` holds
    (seconds since it started, {name: value}); a failed scrape is skipped."""

    def __init__(self, url: str, *prefixes: str, every: float = 0.5):
        import threading

        self.url, self.prefixes, self.every, self.rows = url, prefixes, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.wait(self.every):
            try:
                m = scrape(self.url, *self.prefixes)
            except Exception:  # noqa: BLE001 - a missed sample is a missed sample
                continue
            self.rows.append((time.perf_counter() - t0, m))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def save_plot(fig, ax, path: Path, legend_size=None, dpi: int = 120) -> Path:
    """Finish a one-axes figure the way every benchmark plot looks (grid, legend) and write it."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def bert_flops(cfg, b: int, s: int) -> float:
    """Analytic BERT forward FLOPs: per layer 2BS(4d^2 + 2 d d_ff) for the matmuls + 4BS^2 d for attention."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    return cfg.num_layers * (2 * b * s * (4 * d * d + 2 * d * ff) + 4 * b * s * s * d)


def bert_inputs(cfg, b: int, s: int, seed: int = 0):
    """Random real tokens for a (b, s) cell; the last row is half padding so the key mask is exercised."""
    import numpy as np

    rs = np.random.RandomState(seed + 1000 * b + s)
    ids = rs.randint(1000, cfg.vocab_size, size=(b, s)).astype(np.int32)
    ids[:, 0] = 101
    mask = np.ones((b, s), np.int32)
    mask[-1, s // 2 :] = 0
    ids[mask == 0] = 0
    return ids, mask


if __name__ == "__main__":  # python -m bench.common splice FILE: a section written on another machine
    if len(sys.argv) != 3 or sys.argv[1] != "splice":
        sys.exit("usage: python -m bench.common splice SECTION_FILE")
    splice(Path(sys.argv[2]).read_text())
