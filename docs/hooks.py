"""MkDocs hook: generate the configuration and HTTP reference pages at build time.

A page that holds the line ``<!-- config-reference -->`` gets one table per section of
`serve_rft.config.Config` (every field: type, default, bounds, description), read from the
pydantic models; ``<!-- http-reference -->`` gets one entry per route of
``docs/reference/openapi.json`` (written by ``scripts/openapi_json.py`` from the FastAPI app).
Only `serve_rft.config` is imported (it imports neither torch nor vLLM). MkDocs hooks:
https://www.mkdocs.org/user-guide/configuration/#hooks
"""

from __future__ import annotations

import enum
import json
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG_MARK = "<!-- config-reference -->"
HTTP_MARK = "<!-- http-reference -->"
OPENAPI_JSON = ROOT / "docs" / "reference" / "openapi.json"
BOUND_NAMES = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "min length",
               "max_length": "max length", "multiple_of": "multiple of"}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: replace the reference marks of a page with the generated Markdown."""
    if CONFIG_MARK in markdown:
        markdown = markdown.replace(CONFIG_MARK, config_reference())
    if HTTP_MARK in markdown:
        markdown = markdown.replace(HTTP_MARK, http_reference(json.loads(OPENAPI_JSON.read_text())))
    return markdown


# ---------------------------------------------------------------- configuration

def config_reference() -> str:
    """Markdown: one section per field of `serve_rft.config.Config`, nested models in turn."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pydantic import BaseModel

    from serve_rft.config import Config

    out: list[str] = []
    for name, field in Config.model_fields.items():
        model = _model_of(field.annotation)
        out += _section(name, model, BaseModel)
    return "\n".join(out)


def _section(path: str, model: type, base: type) -> list[str]:
    doc = (model.__doc__ or "").strip()
    lines = [f"## `{path}`", ""]
    if doc and doc != (base.__doc__ or "").strip():
        lines += [" ".join(doc.split()), ""]
    lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    nested: list[tuple[str, type]] = []
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is not None:
            nested.append((f"{path}.{name}", sub))
        lines.append("| `{}` | {} | {} | {} | {} |".format(
            name, _cell(_type_name(field.annotation)), _cell(_default(field)), _cell(_bounds(field)),
            _cell(" ".join((field.description or "").split()))))
    lines.append("")
    for sub_path, sub in nested:
        lines += _section(sub_path, sub, base)
    return lines


def _model_of(annotation: Any) -> type | None:
    """The pydantic model inside ``annotation`` (``X``, ``X | None``), else None."""
    from pydantic import BaseModel

    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return " \\| ".join(f"`{m.value}`" for m in annotation)
        return f"`{annotation.__name__}`"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    text = str(annotation).replace("typing.", "").replace("NoneType", "None")
    return f"`{text}`"


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        factory = field.default_factory
        if getattr(factory, "__name__", "") == "<lambda>":
            return "computed at load (see description)"
        try:
            value = factory()
        except TypeError:
            return "computed at load"
        return _value(value)
    if field.default is PydanticUndefined:
        return "required"
    return _value(field.default)


def _value(value: Any) -> str:
    from pydantic import BaseModel

    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        return "the section's defaults"
    return f"`{json.dumps(value, default=str)}`"


def _bounds(field: Any) -> str:
    found = []
    for item in field.metadata:
        for attr, sign in BOUND_NAMES.items():
            value = getattr(item, attr, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return ", ".join(found)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if "\\|" not in text else text.replace("\n", " ")


# ---------------------------------------------------------------- HTTP

def http_reference(doc: dict[str, Any]) -> str:
    """Markdown: every path and method of an OpenAPI document, its parameters, body and answers."""
    out: list[str] = []
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            out += [f"## `{method.upper()} {path}`", ""]
            if op.get("summary"):
                out += [op["summary"], ""]
            if op.get("description"):
                out += [op["description"].strip(), ""]
            params = op.get("parameters", [])
            if params:
                out += ["| parameter | in | required | type |", "|---|---|---|---|"]
                out += [f"| `{p['name']}` | {p['in']} | {p.get('required', False)} | "
                        f"`{p.get('schema', {}).get('type', '')}` |" for p in params]
                out.append("")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body is not None:
                out += [f"Request body: {_schema_name(body, doc)}", ""]
            answers = ", ".join(f"{code} {resp.get('description', '')}".strip()
                                for code, resp in op.get("responses", {}).items())
            if answers:
                out += [f"Responses: {answers}.", ""]
    return "\n".join(out)


def _schema_name(schema: dict[str, Any], doc: dict[str, Any]) -> str:
    if "$ref" in schema:
        return f"`{schema['$ref'].rsplit('/', 1)[-1]}`"
    title = schema.get("title")
    props = schema.get("properties", {})
    fields = ", ".join(f"`{k}`" for k in props)
    if title and fields:
        return f"`{title}` (fields: {fields})"
    if "anyOf" in schema or "oneOf" in schema:
        parts = schema.get("anyOf") or schema.get("oneOf")
        return " or ".join(_schema_name(p, doc) for p in parts)
    return f"`{title or 'object'}`"
