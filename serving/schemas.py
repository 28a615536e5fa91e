"""Request and response schemas of the HTTP API (pydantic; unknown fields are rejected)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_ITEMS = 64  # inputs per request; more is a 422 naming this limit


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingsRequest(_Strict):
    model: str = "minilm-l6"
    input: str | list[str]
    truncate: bool = False
    slo_ms: float | None = Field(default=None, gt=0)

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v):
        items = [v] if isinstance(v, str) else v
        if len(items) == 0:
            raise ValueError("input must contain at least one string")
        if len(items) > MAX_ITEMS:
            raise ValueError(f"input has {len(items)} items; the limit is {MAX_ITEMS}")
        return v


class _Classify(_Strict):
    model: str
    task: str
    slo_ms: float | None = Field(default=None, gt=0)
    utility: float = Field(default=1.0, ge=0)

    @field_validator("inputs", check_fields=False)
    @classmethod
    def _count(cls, v):
        if len(v) == 0:
            raise ValueError("inputs must contain at least one item")
        if len(v) > MAX_ITEMS:
            raise ValueError(f"inputs has {len(v)} items; the limit is {MAX_ITEMS}")
        return v


class ClassifyTextRequest(_Classify):
    model: str = "minilm-l6"
    task: str = "sentiment"
    inputs: list[str]
    truncate: bool = False


class ClassifyImageRequest(_Classify):
    model: str = "vit-demo"
    task: str = "digits"
    inputs: list[str | list[Any]]


class Meta(BaseModel):
    """How one input was served."""

    shape: str  # the executable's cell, e.g. b8_s32_g0
    batch_size: int
    queue_ms: float
    compute_ms: float
    latency_ms: float  # server-side: arrival to answer (queue + compute + worker hand-off); HTTP excluded
    outcome: str  # ok | late | evicted
    gamma: int | None = None
    outcome_type: int | None = None


class EmbeddingItem(BaseModel):
    object: str = "embedding"
    index: int
    embedding: list[float] | None
    meta: Meta


class EmbeddingsResponse(BaseModel):
    object: str = "list"
    data: list[EmbeddingItem]
    model: str
    usage: dict[str, int]


class ClassifyItem(BaseModel):
    index: int
    label: str | None
    probabilities: dict[str, float] | None
    meta: Meta


class ClassifyResponse(BaseModel):
    model: str
    task: str
    results: list[ClassifyItem]
