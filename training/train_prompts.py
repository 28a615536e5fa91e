"""``jaxserve train-prompts`` as a script (the same flags): OTAS prompts and heads for the
frozen demo ViT. The training itself is the library's, jaxserve/prompt_training.py.

    python -m training.train_prompts [--out DIR] [--tasks digits,parity,inverted] [--prompts 2,4,8] ...
"""

from __future__ import annotations

import sys
from typing import Sequence

from jaxserve.cli import main as jaxserve_main


def main(argv: Sequence[str] | None = None) -> int:
    return jaxserve_main(["train-prompts", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
