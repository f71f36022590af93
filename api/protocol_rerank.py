"""The wire format of the retrieval endpoints beyond embeddings and scores: rerank (`/rerank`,
`/v1/rerank`, `/v2/rerank`: vLLM's, Jina's and Cohere's shape), `/classify` and `/pooling`
(vLLM's), and Cohere's `/v2/embed`, as msgspec Structs with those APIs' field names.

A rerank document is a string or Jina's / Cohere v1's `{"text": ...}`; results come sorted by
`relevance_score`, highest first, each with its `index` in `documents`. Fields a client may send
that this server cannot honour exactly (Cohere's `images`, `inputs`, `relevant_spans`) are
declared so that they are refused with a 400 naming them rather than ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from triollm.api.openai_errors import bad_request
from triollm.api.protocol import Int64
from triollm.api.protocol_pooling import Dimensions, InputRequest, ListResponse, Truncation

__all__ = [
    "ClassificationData",
    "ClassificationRequest",
    "ClassificationResponse",
    "CohereEmbedRequest",
    "CohereEmbedResponse",
    "PoolingData",
    "PoolingRequest",
    "PoolingResponse",
    "RerankRequest",
    "RerankResponse",
    "rerank_documents",
]

TopN = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: list[Any]
    model: str | None = None
    top_n: TopN | None = None  # None or 0: every document
    return_documents: bool = True
    max_tokens_per_doc: PositiveInt | None = None  # Cohere v2: each document cut to this many tokens
    relevant_spans: Any = None  # Cohere v2: refused
    truncate_prompt_tokens: Truncation | None = None
    priority: Int64 = 0
    request_id: str | None = None


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int
    prompt_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
    object: Literal["rerank"] = "rerank"


class ClassificationRequest(InputRequest, kw_only=True):
    use_activation: bool | None = None


class ClassificationData(msgspec.Struct):
    index: int
    label: str
    probs: list[float]
    num_classes: int
    object: Literal["classification"] = "classification"


class ClassificationResponse(ListResponse, kw_only=True):
    data: list[ClassificationData]


class PoolingRequest(InputRequest, kw_only=True):
    task: str | None = None  # None: the model's first task ("embed", "classify" or "token_classify")
    encoding_format: str = "float"
    dimensions: Dimensions | None = None
    normalize: bool | None = None
    use_activation: bool | None = None


class PoolingData(msgspec.Struct):
    index: int
    data: Any  # a vector, one vector per token, or a base64 string
    object: Literal["pooling"] = "pooling"


class PoolingResponse(ListResponse, kw_only=True):
    data: list[PoolingData]


class CohereEmbedRequest(msgspec.Struct, kw_only=True):
    texts: list[str] | None = None
    model: str | None = None
    input_type: str | None = None
    embedding_types: list[str] | None = None  # None: ["float"]
    truncate: str | None = None  # "NONE", "START" or "END" (Cohere's default)
    max_tokens: PositiveInt | None = None
    output_dimension: Dimensions | None = None
    images: Any = None  # refused: no image embedder here
    inputs: Any = None  # refused: mixed text-and-image inputs
    priority: Int64 = 0
    request_id: str | None = None


class CohereApiVersion(msgspec.Struct):
    version: str = "2"


class CohereBilledUnits(msgspec.Struct):
    input_tokens: int


class CohereMeta(msgspec.Struct):
    billed_units: CohereBilledUnits
    api_version: CohereApiVersion = msgspec.field(default_factory=CohereApiVersion)


class CohereEmbedResponse(msgspec.Struct, kw_only=True):
    id: str
    embeddings: dict[str, list[Any]]  # by embedding type: "float" lists, "base64" strings
    texts: list[str]
    meta: CohereMeta
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"


def rerank_documents(documents: list[Any]) -> list[str]:
    """`documents` as texts: strings, or objects with a string `text` (Jina, Cohere v1)."""
    if not documents:
        raise bad_request("documents: must not be an empty list", "documents")
    texts = []
    for i, doc in enumerate(documents):
        if isinstance(doc, dict):
            doc = doc.get("text")
        if not isinstance(doc, str):
            raise bad_request(f"documents[{i}]: must be a string or an object with a string 'text'", "documents")
        texts.append(doc)
    return texts
