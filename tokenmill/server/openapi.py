"""/openapi.json as the server behaves: FastAPI's schema, with the request models' exact bounds and
OpenAI-format 400s where FastAPI documents its 422s."""

from __future__ import annotations

from fastapi import FastAPI

from tokenmill.server.openai_protocol import REQUEST_MODELS
from tokenmill.server.responses_protocol import ResponsesRequest

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
INVALID_REQUEST = {
    "description": "The request is invalid (OpenAI's error format).",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}


LOGPROBS_FIELDS = {"CompletionRequest": ("logprobs", "prompt_logprobs"),
                   "ChatCompletionRequest": ("top_logprobs", "prompt_logprobs")}
"""Fields bounded by the engine's max_logprobs, not by the request models."""


def openapi_spec(app: FastAPI, max_logprobs: int | None = None) -> dict:
    """`max_logprobs`: the engine's, published as the bound of the logprobs fields."""
    spec = FastAPI.openapi(app)
    schemas = spec["components"]["schemas"]
    # FastAPI's OpenAPI model holds bounds as floats, which turns 2**63 - 1 (seed, priority) into 2**63.
    for model in (*REQUEST_MODELS, ResponsesRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update({model.__name__: schema, **schema.pop("$defs", {})})
        for name in LOGPROBS_FIELDS.get(model.__name__, ()) if max_logprobs is not None else ():
            for form in schema["properties"][name].get("anyOf", [schema["properties"][name]]):
                if form.get("type") == "integer":
                    form["maximum"] = max_logprobs
    # Validation errors are answered 400 (errors.py), not 422.
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["Error"] = ERROR_SCHEMA
    for operation in (op for path in spec["paths"].values() for op in path.values()):
        if operation["responses"].pop("422", None) is not None:
            operation["responses"]["400"] = INVALID_REQUEST
    return spec
