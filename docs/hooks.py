"""MkDocs hook: generate the configuration and HTTP reference pages at build time.

A page that holds the line ``<!-- config-reference -->`` gets one table per section of
`serve_rft.config.Config` (every field: type, default, bounds, description), read from the
pydantic models; ``<!-- http-reference -->`` gets one entry per route of
``docs/reference/openapi.json`` (written by ``scripts/openapi_json.py`` from the FastAPI app).
Only `serve_rft.config` is imported (it imports neither torch nor vLLM). A local script of
``extra_javascript`` that is missing (Mermaid, put in place by ``scripts/docs_assets.sh``) is a
warning, so the strict build fails instead of publishing a site whose diagrams need a CDN.
MkDocs hooks: https://www.mkdocs.org/user-guide/configuration/#hooks
"""

from __future__ import annotations

import enum
import json
import logging
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG_MARK = "<!-- config-reference -->"
HTTP_MARK = "<!-- http-reference -->"
OPENAPI_JSON = ROOT / "docs" / "reference" / "openapi.json"
log = logging.getLogger("mkdocs.hooks.serve_rft")
BOUND_NAMES = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "min length",
               "max_length": "max length", "multiple_of": "multiple of"}


def on_config(config: Any) -> Any:
    """MkDocs event: warn (a failure under ``strict``) for each local ``extra_javascript`` file
    missing from the docs folder."""
    for script in config["extra_javascript"]:
        path = str(script)
        if "://" not in path and not (Path(config["docs_dir"]) / path).is_file():
            log.warning("%s is missing from %s: run scripts/docs_assets.sh (scripts/bootstrap.sh runs it)",
                        path, config["docs_dir"])
    return config


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
        kind = _type_name(field.annotation)
        if sub is not None:  # a nested section: link to its own table
            anchor = f"{path}.{name}".replace(".", "").lower()
            kind = kind.replace("section (below)", f"[section `{path}.{name}`](#{anchor})")
        lines.append("| `{}` | {} | {} | {} | {} |".format(
            name, kind, _cell(_default(field)), _cell(_bounds(field)),
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
    """Markdown for a field's type: one code span per alternative, joined by an escaped ``|``."""
    import types

    from pydantic import BaseModel

    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return " \\| ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in typing.get_args(annotation))
    if annotation is type(None):
        return "`null`"
    if origin is dict:
        key, value = typing.get_args(annotation)
        return f"map of {_type_name(key)} to {_type_name(value)}"
    if origin in (list, tuple) and any(_model_of(arg) for arg in typing.get_args(annotation)):
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return " \\| ".join(f"`{json.dumps(m.value)}`" for m in annotation)
        if issubclass(annotation, BaseModel):
            return "section (below)"
        return f"`{annotation.__name__}`"
    return f"`{str(annotation).replace('typing.', '')}`"


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        factory = field.default_factory
        if not isinstance(factory, type):  # a function may read the environment (keys): never call it
            return "computed at load (see description)"
        return _value(factory())
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
    """``text`` fit for one table cell: one line, its ``|`` escaped."""
    return text.replace("\n", " ").replace("|", "\\|")


# ---------------------------------------------------------------- HTTP

SCHEMA_BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<",
                 "minLength": "min length", "maxLength": "max length", "minItems": "min items",
                 "maxItems": "max items"}


def http_reference(doc: dict[str, Any]) -> str:
    """Markdown: every path and method of an OpenAPI document, its parameters, body and answers."""
    out: list[str] = []
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            out += [f"## `{method.upper()} {path}`", ""]
            if op.get("description"):
                out += [" ".join(op["description"].split()), ""]
            elif op.get("summary"):
                out += [op["summary"], ""]
            params = op.get("parameters", [])
            if params:
                out += ["| parameter | in | required | type |", "|---|---|---|---|"]
                out += [f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else 'no'} | "
                        f"{_schema_type(p.get('schema', {}))} |" for p in params]
                out.append("")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body is not None:
                out += _body(body, doc)
            answers = ", ".join(f"{code} {resp.get('description', '')}".strip()
                                for code, resp in op.get("responses", {}).items())
            if answers:
                out += [f"Documented responses: {answers}. Refusals are OpenAI error JSON "
                        "([Errors](../api/errors.md)).", ""]
    return "\n".join(out)


def _resolve(schema: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    return doc["components"]["schemas"][ref.rsplit("/", 1)[-1]]


def _body(schema: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    """The request body: one field table per accepted form."""
    forms = schema.get("anyOf") or schema.get("oneOf") or [schema]
    out = ["Request body" + (f", one of {len(forms)} forms:" if len(forms) > 1 else ":"), ""]
    for form in forms:
        resolved = _resolve(form, doc)
        title = resolved.get("title", "object")
        out += [f"**`{title}`**" + (f": {' '.join(resolved['description'].split())}"
                                    if resolved.get("description") else ""), ""]
        props = resolved.get("properties", {})
        if not props:
            continue
        required = set(resolved.get("required", []))
        out += ["| field | type | required | default | bounds | description |", "|---|---|---|---|---|---|"]
        for name, prop in props.items():
            default = f"`{json.dumps(prop['default'])}`" if "default" in prop else ""
            bounds = ", ".join(f"{sign} {prop[k]}" for k, sign in SCHEMA_BOUNDS.items() if k in prop)
            desc = " ".join((prop.get("description") or "").split())
            out.append(f"| `{name}` | {_schema_type(prop)} | {'yes' if name in required else 'no'} | "
                       f"{_cell(default)} | {bounds} | {_cell(desc)} |")
        out.append("")
    return out


def _schema_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return f"`{schema['$ref'].rsplit('/', 1)[-1]}`"
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if alternatives:
        return " \\| ".join(_schema_type(a) for a in alternatives)
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_schema_type(schema.get('items', {}))}"
    return f"`{kind}`"
