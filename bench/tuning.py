"""What warmup's tuning buys over the fixed option rule, per cell, on this machine.

For every cell the polymorph table compiles each candidate set of XLA options (YNN fusions
on / off; ``Servable.option_candidates``) and times them interleaved, keeping the fastest
(``PolymorphTable``'s tuning). The same measurements give what the fixed rule
(``Servable.options_of``, fitted on a 2-core Xeon, used with ``--no-tune``) would have run,
so each ratio compares timings taken in the same seconds: time of the fixed rule's choice /
time of the tuned choice (1.00 where both chose alike; > 1: tuning is faster).

The timing runs on stand-in weights, as warmup's does (small random floats: the speed of
dense work does not depend on their values, only on their being real memory), so any
config can be measured without its checkpoint.

    python -m bench.tuning [--models minilm-l6,bert-base,vit-b16] [--batch-sizes 8,32]
                           [--buckets 32,64,128,256] [--write]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/tuning.py", "jaxserve/models", "jaxserve/kernels", "jaxserve/polymorph.py",
    "jaxserve/servables.py", "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {"tuning": "--write"}

import argparse
import math

from bench.common import add_quick, apply_quick, record, table


def measure(name: str, batch_sizes: tuple[int, ...], buckets: tuple[int, ...]) -> list[dict]:
    from tqdm import tqdm

    from jaxserve.models.bert import BERT_CONFIGS
    from jaxserve.models.vit import VIT_CONFIGS
    from jaxserve.polymorph import PolymorphTable, options_label
    from jaxserve.sched.base import ShapeGrid
    from jaxserve.servables import bert_servable, vit_servable

    if name in BERT_CONFIGS:
        servable = bert_servable(name, BERT_CONFIGS[name], ShapeGrid(batch_sizes, buckets))
    else:
        servable = vit_servable(name, VIT_CONFIGS[name], ShapeGrid(batch_sizes, gammas=(0,)))
    tuned = PolymorphTable(servable)  # no cache: every cell is compiled and timed here
    rows = []
    for cell in tqdm(servable.grid.cells(), desc=f"tune {name}", unit="cell"):
        row = tuned.warm_cell(cell)
        fixed = options_label(servable.options_of(cell))
        chosen = options_label(row.compile_options)
        rows.append({"model": name, "cell": cell, "fixed": fixed, "tuned": chosen, "ms": row.tuning_ms,
                     "ratio": row.tuning_ms[fixed] / row.tuning_ms[chosen] if row.tuning_ms else math.nan})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="minilm-l6,bert-base")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--buckets", default="32,64,128,256")
    ap.add_argument("--write", action="store_true", help="also write the tuning section of bench/RESULTS.md")
    add_quick(ap, models="minilm-l6", batch_sizes="8", buckets="32")
    args = apply_quick(ap.parse_args())
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    rows = [r for name in args.models.split(",") for r in measure(name, ints(args.batch_sizes), ints(args.buckets))]
    body = table(["model", "B", "S", "fixed rule", "tuned", "best ms per candidate", "fixed / tuned"],
                 [[r["model"], str(r["cell"].batch), str(r["cell"].seq) if r["cell"].seq else "–", r["fixed"],
                   r["tuned"], ", ".join(f"{k} {v:.1f}" for k, v in r["ms"].items()), f"{r['ratio']:.2f}"]
                  for r in rows])
    ratios = [r["ratio"] for r in rows if r["ratio"] == r["ratio"]]
    differ = [r for r in rows if r["fixed"] != r["tuned"]]
    gmean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else math.nan
    notes = (f"Tuning chose other options than the fixed rule in {len(differ)}/{len(rows)} cells; "
             f"fixed / tuned time: geometric mean {gmean:.2f}, largest {max(ratios, default=math.nan):.2f}. "
             "Each ratio comes from one interleaved measurement, so a ratio within a few % of 1 where the choices "
             "differ is a near tie.")
    print(body)
    print(notes)
    if args.write:
        record("tuning", "Warmup's option tuning against the fixed rule", body, notes)


if __name__ == "__main__":
    main()
