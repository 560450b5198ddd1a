"""Request bodies in the OpenAPI schema (/openapi.json).

The routes read their JSON bodies themselves (whatever the content type, with OpenAI-shaped 400s
from the strict models), so FastAPI never sees the body models and would describe no request
body. Each route instead declares its model with `openapi_extra=json_body(Model)`, and the app's
schema gets the models (and the models they use) as components.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
# Every model a route declared, by name (the component it is published under).
_BODY_MODELS: dict[str, type[BaseModel]] = {}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` of a route whose JSON body is `model`."""
    _BODY_MODELS[model.__name__] = model
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_body_schemas(app: FastAPI) -> None:
    """Make app.openapi() publish the declared body models as components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, model in _BODY_MODELS.items():
                schema = model.model_json_schema(ref_template=_REF)
                components.update(schema.pop("$defs", {}))
                components[name] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
