"""Request and response schemas of the HTTP API (pydantic; unknown fields are rejected)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

MAX_ITEMS = 64  # inputs per request; more is a 422 naming this limit


def _unicode(v: str) -> str:
    """JSON may carry a lone UTF-16 surrogate (``"\\udc00"``); Python decodes it into a str
    that no tokenizer or UTF-8 encoder accepts, so it is refused here, naming the position."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone UTF-16 surrogate (U+{ord(v[exc.start]):04X}) at character "
                         f"{exc.start}; text must be valid Unicode") from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]
# slo_ms and utility are finite: JSON's NaN/Infinity (which Python's parser accepts) are 422s.
SloMs = Annotated[float | None, Field(default=None, gt=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    """Unknown fields are refused, and so are values of another JSON type than the field's:
    pydantic's lax mode would read ``"slo_ms": true`` as 1 ms, ``"truncate": "yes"`` as true
    and ``"dimensions": "384"`` as 384 (an integer is still a number for a float field)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class EmbeddingsRequest(_Strict):
    """OpenAI's embeddings request, plus ``truncate`` and ``slo_ms``. ``encoding_format``
    "base64" is what OpenAI's own Python client asks for unless told otherwise: the vector's
    little-endian float32 bytes, base64-encoded. ``dimensions`` must equal the model's width
    (MiniLM is not trained to be cut short, so a shorter vector would not be a good one);
    ``user`` is accepted and ignored. Token-id inputs (OpenAI's lists of ints) are refused:
    ids from another tokenizer would embed garbage."""

    model: Text = "minilm-l6"
    input: Text | list[Text]
    truncate: bool = False
    slo_ms: SloMs = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, gt=0)
    user: Text | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _no_token_ids(cls, v):
        if isinstance(v, list) and v and all(isinstance(x, int) or (isinstance(x, list) and x and all(
                isinstance(y, int) for y in x)) for x in v):
            raise ValueError("token ids are not accepted (ids from another tokenizer would embed garbage); "
                             "send text")
        return v

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
    model: Text
    task: Text
    slo_ms: SloMs = None
    utility: float = Field(default=1.0, ge=0, allow_inf_nan=False)

    @field_validator("inputs", check_fields=False)
    @classmethod
    def _count(cls, v):
        if len(v) == 0:
            raise ValueError("inputs must contain at least one item")
        if len(v) > MAX_ITEMS:
            raise ValueError(f"inputs has {len(v)} items; the limit is {MAX_ITEMS}")
        return v


class ClassifyTextRequest(_Classify):
    # None: the server's default (minilm-l6; "tabi", the cascade, under --policy tabi and its baselines)
    model: Text | None = None
    task: Text = "sentiment"
    inputs: list[Text]
    truncate: bool = False
    # a cascade's rerouting draws derive from it (None: the input text's CRC32): same seed, same route
    seed: int | None = Field(default=None, ge=0, le=2**62)


class ClassifyImageRequest(_Classify):
    model: Text = "vit-demo"
    task: Text = "digits"
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
    embedding: list[float] | str | None  # str: base64 float32 (encoding_format "base64")
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
    # a cascade's answer (--policy tabi...): the models that ran, small to large, the last one's
    # calibrated confidence, and the tokens word pruning took out of the next model's input
    levels: list[str] | None = None
    confidence: float | None = None
    pruned_tokens: int | None = None


class ClassifyResponse(BaseModel):
    model: str
    task: str
    results: list[ClassifyItem]
