"""The retrieval routes beyond embeddings and scores, on a pooling model: rerank (`/rerank`,
`/v1/rerank`, `/v2/rerank`), `/classify`, `/pooling` and Cohere's `/v2/embed`.

They are thin readings of the requests into the engine's pooling tasks, over serving_pooling.py's
helpers (one engine request per prompt, each output read in order, every handle closed on the
way out). Rerank scores each document against the query as `/score` does (`compute_scores`: a
cross-encoder's relevance, or the cosine of embeddings for an embedding model) and returns the
documents sorted by score, highest first (ties keep the documents' order), `top_n` of them.
Long inputs are cut only where the request says so (`truncate_prompt_tokens`, Cohere's
`max_tokens_per_doc` / `max_tokens` and `truncate: END`, Cohere's default); otherwise a prompt
over max_model_len is a 400 naming its field (`documents[3]: ...`).

Cohere's `/v2/embed` answers `embeddings_by_type` with the "float" and "base64" types (base64 of
the little-endian float32 bytes); the quantized types are refused, as is `truncate: START`
(the engine cuts the end of a text). `input_type` is accepted and changes nothing: the model's
own prompts are the client's to add.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from triollm.api.openai_errors import bad_request
from triollm.api.protocol_rerank import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    CohereBilledUnits,
    CohereEmbedRequest,
    CohereEmbedResponse,
    CohereMeta,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    rerank_documents,
)
from triollm.api.serving_common import (
    check_available,
    decode_body,
    request_id_base,
    require_runner,
    resolve_model,
)
from triollm.api.serving_pooling import (
    check_count,
    check_encoding_format,
    compute_scores,
    encode_all,
    encode_inputs,
    encode_vector,
    json_response,
    list_response,
    make_params,
    prompt_tokens,
)
from triollm.api.state import ServerState
from triollm.engine.inputs import PromptType

__all__ = ["create_classify", "create_cohere_embed", "create_pooling", "create_rerank"]

COHERE_EMBEDDING_TYPES = ("float", "base64")
COHERE_TRUNCATE = ("NONE", "END")


async def create_rerank(state: ServerState, request: Request) -> Response:
    check_available(state)
    req = await decode_body(request, RerankRequest)
    model = resolve_model(state, req.model)
    require_runner(state, "pooling", "Rerank API")
    if req.relevant_spans is not None:
        raise bad_request("relevant_spans: not supported (relevance is scored per document)", "relevant_spans")
    if not req.query:
        raise bad_request("query: must not be empty", "query")
    check_count(state, len(req.documents) + 1, "documents")
    documents = rerank_documents(req.documents)
    rid = f"rerank-{request_id_base(request, req.request_id)}"
    scores, tokens = await compute_scores(
        state, [req.query], documents, ("query", "documents"), req.truncate_prompt_tokens, rid, req.priority,
        req.max_tokens_per_doc,
    )  # fmt: skip
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[: req.top_n]
    results = [
        RerankResult(i, scores[i], RerankDocument(documents[i]) if req.return_documents else None) for i in order
    ]
    return json_response(RerankResponse(id=rid, model=model, results=results, usage=RerankUsage(tokens, tokens)))


async def create_classify(state: ServerState, request: Request) -> Response:
    check_available(state)
    req = await decode_body(request, ClassificationRequest)
    model = resolve_model(state, req.model)
    require_runner(state, "pooling", "Classification API")
    params = make_params("classify", req.truncate_prompt_tokens, use_activation=req.use_activation)
    rid, outputs = await encode_inputs(state, request, req, "classify", params)
    pooler = state.llm.get_model_config().pooler
    labels = pooler.id2label if pooler is not None else ()
    data = []
    for i, out in enumerate(outputs):
        probs = out.outputs.data.tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(i, labels[best] if best < len(labels) else str(best), probs, len(probs)))
    return list_response(ClassificationResponse, rid, model, data, prompt_tokens(outputs))


async def create_pooling(state: ServerState, request: Request) -> Response:
    check_available(state)
    req = await decode_body(request, PoolingRequest)
    model = resolve_model(state, req.model)
    require_runner(state, "pooling", "Pooling API")
    check_encoding_format(req.encoding_format)
    pooler = state.llm.get_model_config().pooler
    task = req.task if req.task is not None else (pooler.tasks[0] if pooler is not None else "embed")
    params = make_params(task, req.truncate_prompt_tokens, req.dimensions, req.normalize, req.use_activation)
    rid, outputs = await encode_inputs(state, request, req, "pool", params)
    data = [PoolingData(i, encode_vector(out.outputs.data, req.encoding_format)) for i, out in enumerate(outputs)]
    return list_response(PoolingResponse, rid, model, data, prompt_tokens(outputs))


async def create_cohere_embed(state: ServerState, request: Request) -> Response:
    check_available(state)
    req = await decode_body(request, CohereEmbedRequest)
    resolve_model(state, req.model)
    require_runner(state, "pooling", "Embed API")
    for name in ("images", "inputs"):
        if getattr(req, name) is not None:
            raise bad_request(f"{name}: not supported (this server embeds texts: send `texts`)", name)
    if not req.texts:
        raise bad_request("texts: required, a non-empty list of strings", "texts")
    check_count(state, len(req.texts), "texts")
    if not all(req.texts):
        raise bad_request("texts: the strings must not be empty", "texts")
    types = req.embedding_types or ["float"]
    for kind in types:
        if kind not in COHERE_EMBEDDING_TYPES:
            raise bad_request(
                f"embedding_types: {kind!r} is not supported; allowed: {', '.join(COHERE_EMBEDDING_TYPES)}",
                "embedding_types",
            )
    truncate = req.truncate or "END"
    if truncate not in COHERE_TRUNCATE:
        raise bad_request(f"truncate: {truncate!r} is not supported; allowed: {', '.join(COHERE_TRUNCATE)}", "truncate")
    if truncate == "NONE" and req.max_tokens is not None:
        raise bad_request("max_tokens: cuts each text, which truncate 'NONE' forbids (send 'END')", "max_tokens")
    keep = (req.max_tokens or -1) if truncate == "END" else None
    if keep is not None and keep != -1:
        keep = min(keep, state.llm.get_model_config().max_model_len)
    rid = f"embed-{request_id_base(request, req.request_id)}"
    prompts: list[PromptType] = list(req.texts)
    params = make_params("embed", keep, req.output_dimension)
    outputs = await encode_all(state, prompts, params, rid, req.priority, "texts")
    embeddings = {kind: [encode_vector(out.outputs.data, kind) for out in outputs] for kind in types}
    tokens = prompt_tokens(outputs)
    body = CohereEmbedResponse(
        id=rid, embeddings=embeddings, texts=list(req.texts), meta=CohereMeta(CohereBilledUnits(tokens))
    )
    return json_response(body)
