"""Shared by the benchmarks: markdown tables and recording them in bench/RESULTS.md.

Each benchmark owns one section of RESULTS.md, delimited by HTML comments, and
rewrites only that section, stamped with the machine, the date and the command.
"""

from __future__ import annotations

import datetime as _dt
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "RESULTS.md"
PLOTS = Path(__file__).parent / "plots"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def machine() -> str:
    from jaxserve.profiler import machine_description

    import jax

    dev = jax.devices()[0]
    kind = "" if dev.platform == "cpu" else f"; {dev.device_kind}"
    return f"{machine_description()}; jax {jax.__version__} on {dev.platform}{kind}"


def invocation() -> list[str]:
    """argv as a user would retype it from the repository root: ``-m bench.x`` for a script here."""
    script = Path(sys.argv[0]).resolve()
    if script.parent == Path(__file__).resolve().parent and script.suffix == ".py":
        return ["-m", f"bench.{script.stem}", *sys.argv[1:]]
    return sys.argv


def section(key: str, title: str, body: str, notes: str = "", machine_text: str | None = None) -> str:
    """One RESULTS.md section, stamped with the machine, the date and this command."""
    command = "python " + " ".join(shlex.quote(a) for a in invocation())
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (f"<!-- bench:{key} -->\n## {title}\n\n"
            f"*Machine:* {machine_text or machine()}  \n*Date:* {stamp}  \n*Command:* `{command}`\n\n"
            f"{body}\n\n{notes}\n<!-- /bench:{key} -->")


def record(key: str, title: str, body: str, notes: str = "") -> None:
    """Replace (or append) the ``key`` section of bench/RESULTS.md."""
    splice(section(key, title, body, notes))


def splice(section_text: str) -> None:
    """Put a section made by :func:`section` (here or on another machine) into RESULTS.md,
    replacing the one with the same key."""
    key = section_text.split("<!-- bench:", 1)[1].split(" -->", 1)[0]
    new = section_text.strip()
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\nEach section is rewritten by the script named in it.\n"
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + new + tail
    else:
        text = text.rstrip() + "\n\n" + new + "\n"
    RESULTS.write_text(text)


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
