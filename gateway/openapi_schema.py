"""The gateway's /openapi.json, completed: the bodies the HTTP app parses itself and the
OpenAI error shape every route answers with (FastAPI sees neither).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
            },
        }
    },
}


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Declares in /openapi.json the bodies ``parse_body`` reads (FastAPI cannot see them)
    and the OpenAI error shape of every route's 4xx and 5xx."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["ErrorResponse"] = ERROR_SCHEMA
        error = {
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
            }
        }
        for path, ops in schema["paths"].items():
            for op in ops.values():
                op.setdefault("responses", {}).update(
                    {
                        "4XX": {"description": "OpenAI error", **error},
                        "5XX": {"description": "OpenAI error", **error},
                    }
                )
                model = bodies.get(path)
                if model is None:
                    continue
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": ref}},
                }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
