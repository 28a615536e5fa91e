"""The peer for bench/load.py: a plain FastAPI endpoint that runs the jitted MiniLM once
per request — no batching, no buckets, no queue; ``jax.jit`` compiles each new length
on first sight, as a straightforward JAX service would. ``--precision bf16`` gives it
jaxserve's bf16 dense kernels (jaxserve/models/precision.py), for a like-for-like peer."""

from __future__ import annotations

import argparse

import jax
import numpy as np
import uvicorn
from fastapi import FastAPI
from flax import nnx
from pydantic import BaseModel

from jaxserve.models.bert import load_hf_bert, make_encode_fn
from jaxserve.models.precision import PRECISIONS, matmul_weights
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.registry import minilm_dir


class Req(BaseModel):
    input: str
    slo_ms: float | None = None


def build(precision: str = "f32") -> FastAPI:
    cfg, model = load_hf_bert(minilm_dir())
    graphdef, state = nnx.split(model)
    state = matmul_weights(state, precision)
    encode = jax.jit(make_encode_fn(graphdef))
    tok = TextTokenizer(minilm_dir() / "tokenizer.json")
    app = FastAPI()

    @app.post("/v1/embeddings")
    def embeddings(req: Req):  # sync: FastAPI runs it in its thread pool
        ids = np.array([tok.truncate(tok.encode([req.input])[0], 256)], np.int32)
        out = encode(state, ids, np.ones_like(ids))
        return {"data": [{"embedding": np.asarray(out["embedding"][0]).tolist(), "index": 0}]}

    @app.get("/readyz")
    def readyz():
        return {"status": "ready"}

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--precision", default="f32", choices=PRECISIONS)
    args = ap.parse_args()
    uvicorn.run(build(args.precision), host="127.0.0.1", port=args.port, log_level="warning")
