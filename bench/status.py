"""Which sections of bench/RESULTS.md measure code older than the repository's.

    python -m bench.status [--results FILE] [--check] [--json]

Each section's stamp (bench.common.stamp) names the commit it measured; each bench script
declares the files its numbers measure (``MEASURES``, bench/common.py). A section is

- ``fresh``: its stamped commit contains the last commit that changed any of those files, and
  the stamp does not say ``+uncommitted``;
- ``stale``: a measured file changed in a commit its stamped commit lacks (or the stamp says
  ``+uncommitted``: the numbers measured edits no commit held when they ran). The detail names
  the changed files. A ``+uncommitted`` stamp that lists what its run measured
  (``*Uncommitted:* path@blob``: inputs an earlier run of the same ``make bench`` wrote, such
  as a cost model) is judged as of the commits that committed exactly those contents (see
  :func:`_judge`), so one ``make bench`` whose outputs are then committed leaves no section
  stale;
- ``fresh (waived)``: every such commit is named in one of the section's own
  ``*Unaffected by:* <commit> — <why>`` lines, a hand-written claim that the commit changes
  nothing the section measured (a rename, a path its runs never take). The claim names
  commits, not files, so any later change makes the section stale again; the detail lists
  the waived commits, and the reason stays in the section for a reader to judge;
- ``unstamped``: written before stamps named a commit. For the real RESULTS.md, the detail
  says in which commit the section's text was recorded (``git blame`` of its date line) and
  whether a measured file changed after it: a hint, not a verdict;
- ``unknown``: stamped with a commit this clone does not have;
- ``undeclared``: no script declares the section.

GPU sections are listed like the others (``gpu`` column): ``make bench`` never reruns them.
A rerun carries a section's hand-written reading over to its new numbers under a
``*Carried over:*`` line (bench.common.carried_reading): the reading was written about the old
numbers. Such sections are named under the table, to be checked against the new numbers and the
line deleted; the JSON's ``review`` field holds the line.

With ``--check`` the exit status is 1 when any section is stale (``--strict``: or unstamped,
unknown, undeclared, or holding a carried-over reading), else 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import CANONICAL_RESULTS, CARRIED_MARK, ROOT, declared_scripts, git

# Sections written by something other than a bench script (which cannot carry MEASURES):
# key -> (the writer, what it measures).
EXTERNAL = {
    "otas-accuracy-dinov2-s14": ("training.train_dinov2_probes", (
        "training/train_dinov2_probes.py", "jaxserve/models", "jaxserve/prompts.py", "jaxserve/datasets.py",
        "jaxserve/assets/dinov2-s14-prompts")),
}

_OPEN = re.compile(r"^<!-- bench:(?P<key>[^ ]+) -->$", re.M)


@dataclass
class Section:
    key: str
    title: str
    line: int                 # 1-based line of the opening marker
    text: str                 # from the opening marker to the closing one
    fields: dict = field(default_factory=dict)  # Commit, Machine, Versions, Date, Command (stamp lines)
    quick: bool = False

    @property
    def commit(self) -> str:
        return self.fields.get("Commit", "").split()[0] if self.fields.get("Commit") else ""

    @property
    def uncommitted(self) -> bool:
        return "+uncommitted" in self.fields.get("Commit", "")

    @property
    def measured_blobs(self) -> dict[str, str]:
        """``{path: blob}`` from the stamp's ``*Uncommitted:*`` line: the uncommitted contents of
        measured files the run read (bench.common.uncommitted_blobs); {} for none."""
        out = {}
        for item in self.fields.get("Uncommitted", "").split(", "):
            path, _, blob = item.strip().rpartition("@")
            if path and blob:
                out[path] = blob
        return out

    @property
    def machine(self) -> str:
        """The stamp's machine, short: the GPU's name for a GPU run, else the CPU and cores."""
        m = self.fields.get("Machine") or self.fields.get("machine", "")
        parts = [p.strip() for p in re.split(r";| — ", m) if p.strip()]
        gpu = [p for p in parts if "NVIDIA" in p or "H100" in p or "H200" in p]
        if gpu:
            return re.sub(r"\s*\(.*", "", gpu[0])
        head = parts[0] if parts else ""
        return re.sub(r",? (\d+) CPUs visible.*", r", \1 cores", head)  # the peer reports' wording

    @property
    def date(self) -> str:
        return (self.fields.get("Date") or self.fields.get("date", "")).split(" (")[0]


def parse_sections(text: str) -> list[Section]:
    """Every ``<!-- bench:KEY -->`` ... ``<!-- /bench:KEY -->`` section of a RESULTS.md text, in
    order, with its title and stamp fields (``*Name:* value`` lines, or the peer reports' older
    ``- name: value`` lines). ValueError for a section that is opened and never closed."""
    out = []
    for m in _OPEN.finditer(text):
        key = m.group("key")
        end = text.find(f"<!-- /bench:{key} -->", m.end())
        if end < 0:
            raise ValueError(f"section {key!r} is never closed")
        body = text[m.start():end + len(f"<!-- /bench:{key} -->")]
        title = next((ln[3:].strip() for ln in body.splitlines() if ln.startswith("## ")), "")
        fields = {}
        for ln in body.splitlines()[:16]:
            s = re.match(r"^\*(Commit|Uncommitted|Machine|Versions|Date|Command):\* (.*?)\s*$", ln)
            if s:
                fields[s.group(1)] = s.group(2).strip("`")
            s = re.match(r"^- (command|date|machine): (.*)$", ln)
            if s:
                fields.setdefault(s.group(1), s.group(2).strip("`"))
        from bench.common import QUICK_MARK

        out.append(Section(key, title, text.count("\n", 0, m.start()) + 1, body, fields, QUICK_MARK in body))
    return out


def declared() -> dict[str, dict]:
    """``{section key: {"script", "measures", "gpu", "args"}}`` from every script's declarations
    and :data:`EXTERNAL`."""
    out = {}
    for name, d in declared_scripts().items():
        measures = tuple(d.get("MEASURES", ()))
        for key, args in d.get("SECTIONS", {}).items():
            out[key] = {"script": f"bench.{name}", "measures": measures, "gpu": False, "args": args}
        for key, args in d.get("GPU_SECTIONS", {}).items():
            out[key] = {"script": f"bench.{name}", "measures": measures, "gpu": True, "args": args}
    for key, (writer, measures) in EXTERNAL.items():
        out[key] = {"script": writer, "measures": measures, "gpu": False, "args": None}
    return out


@dataclass
class Status:
    key: str
    state: str            # fresh | stale | unstamped | unknown | undeclared
    script: str
    gpu: bool
    stamped: str          # the stamped commit (short), or ''
    last_change: str      # the last commit that changed a measured file (short), or ''
    detail: str
    machine: str
    date: str
    title: str
    review: str = ""      # a hand-written reading carried over by a rerun, to check: its first line


def _short(h: str) -> str:
    return h[:9]


def _last_change(measures) -> str:
    return git("log", "-1", "--format=%H", "--", *measures) if measures else ""


def _contains(descendant: str, ancestor: str) -> bool:
    import subprocess

    r = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, descendant], cwd=ROOT,
                       capture_output=True)
    return r.returncode == 0


def _changed_since(commit: str, measures) -> list[str]:
    return [f for f in git("diff", "--name-only", commit, "HEAD", "--", *measures).splitlines() if f]


_WAIVER = re.compile(r"^\*Unaffected by:\* ([0-9a-f]{7,40})\b", re.M)


def _commits_since(commit: str, measures) -> dict[str, set[str]]:
    """``{commit: the measured files it changed}`` for the commits after ``commit`` (to HEAD)."""
    out, cur = {}, None
    for ln in git("log", "--format=%H", "--name-only", f"{commit}..HEAD", "--", *measures).splitlines():
        if re.fullmatch(r"[0-9a-f]{40}", ln):
            cur = out.setdefault(ln, set())
        elif ln.strip() and cur is not None:
            cur.add(ln.strip())
    return out


def _judge(s: "Section", measures, last: str, head: str) -> tuple[str, str]:
    """``(state, detail)`` of a stamped section whose commit this clone has (the module docstring).

    A ``+uncommitted`` run that lists what it measured (``*Uncommitted:*``, bench.common.stamp) is
    judged as of the commits that committed those contents: when HEAD holds every listed file as
    measured, the commits after the stamp that changed only listed files are accounted for (an
    earlier run of the same ``make bench`` wrote them: a cost model, a profile), and the section
    is judged by the other commits alone. A listed file that HEAD holds otherwise, or a
    ``+uncommitted`` stamp without the list, is stale."""
    commits = _commits_since(s.commit, measures) if last and not _contains(s.commit, last) else {}
    accounted = []
    if s.uncommitted:
        blobs = s.measured_blobs
        if not blobs:
            return "stale", "measured uncommitted edits of its files"
        for path, blob in sorted(blobs.items()):
            if (git("rev-parse", f"HEAD:{path}") or "-") != blob:
                return "stale", f"measured an uncommitted {path} that HEAD holds otherwise"
        accounted = [c for c, files in commits.items() if files <= set(blobs)]
    others = [c for c in commits if c not in accounted]
    named = _WAIVER.findall(s.text)
    note = (f"; its uncommitted inputs ({', '.join(sorted(s.measured_blobs))}) committed as measured in "
            + ", ".join(_short(c) for c in accounted)) if accounted else ""
    if not others:
        behind = "" if s.commit == head else f" (HEAD is {_short(head)}; no measured file changed since)"
        return "fresh", ("up to date" + note) if note else ("up to date" + behind)
    unwaived = [c for c in others if not any(c.startswith(n) for n in named)]
    if not unwaived:
        return "fresh", ("up to date but for " + ", ".join(_short(c) for c in others)
                         + ", waived in the section (*Unaffected by:*)" + note)
    changed = sorted(set().union(*(commits[c] for c in unwaived)))
    return "stale", ("changed since: " + ", ".join(changed[:4])
                     + (f" (+{len(changed) - 4})" if len(changed) > 4 else "") + note)


def _recorded_in(results: Path, line: int) -> str:
    """The commit that recorded line ``line`` of the real RESULTS.md as it stands in the working
    tree, or '' (not committed yet). Blaming the working tree, not HEAD: ``line`` is a line
    number in the file on disk, which uncommitted edits above it shift."""
    try:
        rel = results.resolve().relative_to(ROOT)
    except ValueError:
        return ""
    out = git("blame", "--porcelain", "-L", f"{line},{line}", "--", str(rel))
    h = out.split(" ", 1)[0] if out else ""
    return "" if not h or set(h) == {"0"} else h


def status(results: Path = CANONICAL_RESULTS, infer: bool | None = None) -> list[Status]:
    """Every section of ``results`` with its state (see the module docstring). ``infer``: look up
    where unstamped sections were recorded (default: only for the real RESULTS.md)."""
    results = Path(results)
    infer = results.resolve() == CANONICAL_RESULTS.resolve() if infer is None else infer
    decl = declared()
    head = git("rev-parse", "HEAD")
    out = []
    sections = parse_sections(results.read_text())
    for s in sections:
        d = decl.get(s.key)
        gpu = bool(d and d["gpu"]) or "GPU" in s.title
        common = dict(key=s.key, gpu=gpu, machine=s.machine, date=s.date, title=s.title,
                      script=d["script"] if d else "")
        if d is None:
            out.append(Status(state="undeclared", stamped=_short(s.commit), last_change="",
                              detail="no bench script declares this section", **common))
            continue
        last = _last_change(d["measures"])
        if not s.commit:
            detail = "written before stamps named a commit"
            if infer:
                date_line = next((s.line + i for i, ln in enumerate(s.text.splitlines())
                                  if re.match(r"^(\*Date:\*|- date:)", ln)), s.line)
                rec = _recorded_in(results, date_line)
                if rec:
                    changed = _changed_since(rec, d["measures"])
                    detail = (f"recorded in {_short(rec)}; measured files changed since: "
                              + (", ".join(changed[:3]) + (f" (+{len(changed) - 3})" if len(changed) > 3 else "")
                                 if changed else "none"))
            out.append(Status(state="unstamped", stamped="", last_change=_short(last), detail=detail, **common))
            continue
        if s.commit == "unknown" or not _exists(s.commit):
            out.append(Status(state="unknown", stamped=_short(s.commit), last_change=_short(last),
                              detail=f"commit {s.commit} is not in this clone", **common))
            continue
        state, detail = _judge(s, d["measures"], last, head)
        out.append(Status(state=state, stamped=_short(s.commit), last_change=_short(last), detail=detail, **common))
    for row, s in zip(out, sections, strict=True):
        row.review = next((ln.strip() for ln in s.text.splitlines() if ln.startswith(CARRIED_MARK)), "")
    return out


def _exists(commit: str) -> bool:
    import subprocess

    return subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT,
                          capture_output=True).returncode == 0


def render(rows: list[Status]) -> str:
    head = ["state", "section", "gpu", "script", "stamped", "last change", "machine", "detail"]
    table = [[r.state, r.key, "GPU" if r.gpu else "", r.script, r.stamped or "-", r.last_change or "-",
              r.machine, r.detail] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    widths[-1] = 0
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [head, *table]]
    counts = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    review = [r.key for r in rows if r.review]
    lines.append("")
    lines.append(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    if review:
        lines.append(f"hand-written readings carried over by a rerun, to check against the new numbers "
                     f"(then delete their *Carried over:* line): {', '.join(review)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=CANONICAL_RESULTS, help="a RESULTS.md (default bench/RESULTS.md)")
    ap.add_argument("--check", action="store_true", help="exit 1 if any section is stale")
    ap.add_argument("--strict", action="store_true",
                    help="with --check: unstamped, unknown, undeclared and readings carried over unchecked fail too")
    ap.add_argument("--json", action="store_true", help="one JSON object per section")
    args = ap.parse_args(argv)
    rows = status(args.results)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(render(rows))
    bad = {"stale"} | ({"unstamped", "unknown", "undeclared"} if args.strict else set())
    return 1 if args.check and any(r.state in bad or (args.strict and r.review) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
