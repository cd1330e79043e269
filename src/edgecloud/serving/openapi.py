"""The OpenAPI document ``edgecloud serve`` publishes at ``/openapi.json``.

The routes read their JSON bodies themselves (to bound size and nesting before parsing and to
answer every failure in OpenAI's error shape), so FastAPI cannot infer their schemas. This
module writes them from the same pydantic models that validate the requests and build the
answers: :class:`~edgecloud.types.ChatRequest` / :class:`~edgecloud.types.ChatCompletion`,
:class:`~edgecloud.runtime.completions.CompletionRequest` /
:class:`~edgecloud.runtime.completions.Completion`, and the OpenAI error body, so schema-driven
tools (schemathesis, client generators) see the real shapes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .._version import __version__
from ..types import ChatCompletion, ChatRequest
from ..runtime.completions import Completion, CompletionRequest

__all__ = ["openapi_document"]

_REF = "#/components/schemas/{model}"
_ERROR_STATUSES = {
    "400": "The request is malformed; `error.param` names the field.",
    "401": "Missing or wrong API key.",
    "404": "Unknown model.",
    "413": "The body is larger than the server accepts.",
    "429": "The queue is full; see Retry-After.",
    "503": "The engine cannot serve now (it is loading, restarting or gone).",
}
_ERROR_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


def _schema(model: type[BaseModel], mode: str, components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF, mode=mode)  # type: ignore[arg-type]
    components.update(schema.pop("$defs", {}))
    name = f"{model.__name__}{'' if mode == 'validation' else 'Response'}"
    components[name] = schema
    return {"$ref": _REF.format(model=name)}


def _generation(summary: str, request: type[BaseModel], answer: type[BaseModel],
                components: dict[str, Any]) -> dict[str, Any]:
    return {
        "summary": summary,
        "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _schema(request, "validation", components)}}},
        "responses": {
            "200": {
                "description": "The answer; with `stream: true` a server-sent event stream of chunks ending in `[DONE]`.",
                "content": {
                    "application/json": {"schema": _schema(answer, "serialization", components)},
                    # each event's data is one JSON chunk, then "[DONE]": documented, not schema-checked
                    "text/event-stream": {},
                },
            },
            **_errors(),
        },
    }


def _errors(*statuses: str) -> dict[str, Any]:
    chosen = statuses or tuple(_ERROR_STATUSES)
    return {
        status: {"description": _ERROR_STATUSES[status],
                 "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
        for status in chosen
    }


def openapi_document(model_name: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of an ``edgecloud serve`` app serving ``model_name``."""
    components: dict[str, Any] = {"ErrorResponse": _ERROR_BODY}
    health = {
        "type": "object",
        "required": ["status", "model"],
        "properties": {"status": {"enum": ["ok", "unavailable"]}, "model": {"type": "string"},
                       "reason": {"type": "string"}},
    }
    models = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object", "created", "owned_by"],
                "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                               "created": {"type": "integer"}, "owned_by": {"type": "string"}},
            }},
        },
    }
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": _generation("Chat completion (OpenAI-compatible)", ChatRequest,
                                                     ChatCompletion, components)},
        "/v1/completions": {"post": _generation("Text completion (OpenAI-compatible)", CompletionRequest,
                                                Completion, components)},
        "/v1/models": {"get": {
            "summary": f"The model this server serves ({model_name})",
            "security": [{"bearer": []}],
            "responses": {"200": {"description": "One model card.", "content": {"application/json": {"schema": models}}},
                          **_errors("401")},
        }},
        "/health": {"get": {
            "summary": "200 only when a request could be served now; 503 with the reason otherwise",
            "responses": {
                "200": {"description": "Serving.", "content": {"application/json": {"schema": health}}},
                "503": {"description": "Not serving; `reason` says why.", "content": {"application/json": {"schema": health}}},
            },
        }},
        "/metrics": {"get": {
            "summary": "Prometheus metrics",
            "responses": {"200": {"description": "Prometheus text format.",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}},
        }},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "edgecloud serve", "version": __version__,
                 "description": "An OpenAI-compatible endpoint. Errors have OpenAI's shape."},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
