"""MkDocs hook: generate the reference parts of the site at build time.

- ``<!-- config-reference -->``: one table per section of `serve_rft.config.Config` (every field:
  type and bounds, default, description), read from the pydantic models.
- ``<!-- http-routes -->``: one row per route of ``docs/reference/openapi.json`` (written by
  ``scripts/openapi_json.py`` from the FastAPI app) with the key scope it takes
  (`serve_rft.explorer.http.auth.required_scope`).
- ``<!-- refused-fields -->``: the chat and completion fields the service refuses, when each is
  served and why (`serve_rft.explorer.http.openai_request.REFUSED`).
- ``reference/openapi.site.json``, a generated file: the OpenAPI document as the HTTP API page's
  Swagger UI shows it, with the descriptions and examples of ``docs/reference/http_examples.yaml``,
  the key scheme, and the refused fields marked (`site_openapi`).

Imported: `serve_rft.config` and the HTTP modules named above (neither torch nor vLLM). A local
script of ``extra_javascript`` that is missing (Mermaid, put in place by
``scripts/docs_assets.sh``) is a warning, so the strict build fails instead of publishing a site
whose diagrams need a CDN. MkDocs hooks: https://www.mkdocs.org/user-guide/configuration/#hooks
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
ROUTES_MARK = "<!-- http-routes -->"
REFUSED_MARK = "<!-- refused-fields -->"
OPENAPI_JSON = ROOT / "docs" / "reference" / "openapi.json"
HTTP_EXAMPLES = ROOT / "docs" / "reference" / "http_examples.yaml"
SITE_OPENAPI = "reference/openapi.site.json"
log = logging.getLogger("mkdocs.hooks.serve_rft")
BOUND_NAMES = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "min length",
               "max_length": "max length", "multiple_of": "multiple of"}


def _importable() -> None:
    """Make the checkout's ``serve_rft`` importable (mkdocs runs from the repository root)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def on_config(config: Any) -> Any:
    """MkDocs event: warn (a failure under ``strict``) for each local ``extra_javascript`` file
    missing from the docs folder."""
    for script in config["extra_javascript"]:
        path = str(script)
        if "://" not in path and not (Path(config["docs_dir"]) / path).is_file():
            log.warning("%s is missing from %s: run scripts/docs_assets.sh (scripts/bootstrap.sh runs it)",
                        path, config["docs_dir"])
    return config


def _openapi() -> tuple[dict[str, Any], dict[str, Any]]:
    """The committed OpenAPI document and the site's examples."""
    import yaml

    return json.loads(OPENAPI_JSON.read_text()), yaml.safe_load(HTTP_EXAMPLES.read_text())


def on_files(files: Any, config: Any) -> Any:
    """MkDocs event: add ``reference/openapi.site.json`` (`site_openapi`)."""
    from mkdocs.structure.files import File

    doc = site_openapi(*_openapi())
    files.append(File.generated(config, SITE_OPENAPI, content=json.dumps(doc, indent=1, ensure_ascii=False)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: replace the reference marks of a page with the generated Markdown."""
    if CONFIG_MARK in markdown:
        markdown = markdown.replace(CONFIG_MARK, config_reference())
    if ROUTES_MARK in markdown:
        markdown = markdown.replace(ROUTES_MARK, http_routes(*_openapi()))
    if REFUSED_MARK in markdown:
        markdown = markdown.replace(REFUSED_MARK, refused_fields(_openapi()[0]))
    return markdown


# ---------------------------------------------------------------- configuration

def config_reference() -> str:
    """Markdown: one section per field of `serve_rft.config.Config`, nested models in turn."""
    _importable()
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
    lines += ["| field | type and bounds | default | description |", "|---|---|---|---|"]
    nested: list[tuple[str, type]] = []
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is not None:
            nested.append((f"{path}.{name}", sub))
        kind = _type_name(field.annotation)
        if sub is not None:  # a nested section: link to its own table
            anchor = f"{path}.{name}".replace(".", "").lower()
            kind = kind.replace("section (below)", f"[section `{path}.{name}`](#{anchor})")
        bounds = _bounds(field)
        lines.append("| `{}` | {} | {} | {} |".format(
            name, kind + (f", {_cell(bounds)}" if bounds else ""), _cell(_default(field)),
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


# ---------------------------------------------------------------- HTTP

NEUTRAL_CANDIDATES = (None, 0, -1, 1.0, False, [], {})
"""Values tried against each refused field's neutral-value rule (`REFUSED`) to say which are served."""
JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object"}


def _refused(path: str | None = None) -> dict[str, tuple[Any, str]]:
    """The request fields the service refuses on ``path`` (None: on chat and completions): name ->
    (is this value neutral?, why), from the code."""
    _importable()
    from serve_rft.explorer.http.openai_request import REFUSED, RESPONSES_REFUSED

    return {**REFUSED, **RESPONSES_REFUSED} if path == "/v1/responses" else REFUSED


def _types(schema: dict[str, Any]) -> set[str]:
    """JSON types a property's schema admits (``anyOf`` alternatives included; any, if it says none)."""
    alternatives = schema.get("anyOf") or schema.get("oneOf") or [schema]
    return {a["type"] for a in alternatives if isinstance(a.get("type"), str)} or set(JSON_TYPES.values())


def _served_values(neutral: Any, schema: dict[str, Any]) -> list[str]:
    """The values of `NEUTRAL_CANDIDATES` that the field's type admits and its rule serves, as JSON."""
    admitted = _types(schema)
    return [json.dumps(value) for value in NEUTRAL_CANDIDATES
            if (JSON_TYPES[type(value)] in admitted
                or (JSON_TYPES[type(value)] == "integer" and "number" in admitted)) and neutral(value)]


def _request_schema(doc: dict[str, Any], path: str) -> dict[str, Any] | None:
    return (doc["paths"].get(path, {}).get("post", {}).get("requestBody", {}).get("content", {})
            .get("application/json", {}).get("schema"))


def refused_fields(doc: dict[str, Any]) -> str:
    """Markdown: the refused request fields of chat, completions and responses, when each is
    served, and why."""
    chat = (_request_schema(doc, "/v1/chat/completions") or {}).get("properties", {})
    text = (_request_schema(doc, "/v1/completions") or {}).get("properties", {})
    responses = (_request_schema(doc, "/v1/responses") or {}).get("properties", {})
    out = ["| field | served only when | why any other value is refused |", "|---|---|---|"]
    rows = [(name, rule, "" if name in chat else " (completions)", chat.get(name) or text.get(name) or {})
            for name, rule in _refused().items()]
    rows += [(name, rule, " (responses)", responses.get(name) or {})
             for name, rule in _refused("/v1/responses").items() if name not in _refused()]
    for name, (neutral, why), where, schema in rows:
        served = "".join(f" or `{v}`" for v in _served_values(neutral, schema))
        out.append(f"| `{name}`{where} | absent{served} | {_cell(why)} |")
    return "\n".join(out) + "\n"


def http_routes(doc: dict[str, Any], examples: dict[str, Any]) -> str:
    """Markdown: one row per route of the OpenAPI document, with the key scope it takes."""
    _importable()
    from serve_rft.explorer.http.auth import required_scope

    out = ["| route | key scope | what it does |", "|---|---|---|"]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            what = examples.get(path, {}).get(method, {}).get("summary") or op.get("summary", "")
            scope = required_scope(path) or "none (open)"
            out.append(f"| `{method.upper()} {path}` | {scope} | {_cell(what)} |")
    return "\n".join(out) + "\n"


def site_openapi(doc: dict[str, Any], examples: dict[str, Any]) -> dict[str, Any]:
    """The copy of the OpenAPI document the site shows: ``examples``' descriptions, request and
    response examples, a bearer scheme on every route that takes a key (its scope said), and each
    refused request field marked (``deprecated``, its description opening with **Refused**).

    Warns (a failure under ``strict``) for an example of a route or method the document lacks."""
    import copy

    _importable()
    from serve_rft.explorer.http.auth import required_scope
    from serve_rft.explorer.http.protocol import ApiError

    doc = copy.deepcopy(doc)
    doc.setdefault("components", {})["securitySchemes"] = {"apiKey": {
        "type": "http", "scheme": "bearer",
        "description": "An API key when the service has keys (`service.api_keys`, `reward_keys`, `admin_keys`): "
                       "inference, rewards or admin scope."}}
    for path, methods in doc["paths"].items():
        refused = _refused(path)
        for method, op in methods.items():
            scope = required_scope(path)
            if scope is not None:
                op["security"] = [{"apiKey": []}]
            ours = examples.get(path, {}).get(method, {})
            for key in ("tags", "summary", "description"):
                if ours.get(key):
                    op[key] = ours[key]
            op["description"] = (op.get("description", "") + f"\n\nKey scope: **{scope or 'none (open)'}**.").strip()
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None and ours.get("request"):
                body["examples"] = ours["request"]
            for code, answer in ours.get("responses", {}).items():
                response = op.setdefault("responses", {}).setdefault(code, {})
                response["description"] = answer.get("description", response.get("description", ""))
                media = response.setdefault("content", {}).setdefault("application/json", {"schema": {}})
                media["examples"] = answer["examples"]
            schema = _request_schema({"paths": {path: methods}}, path) if method == "post" else None
            props = (schema or {}).get("properties", {})
            marked = [name for name in refused if name in props]
            for name in marked:
                neutral, why = refused[name]
                served = ", ".join(f"`{v}`" for v in _served_values(neutral, props[name]))
                props[name]["deprecated"] = True
                props[name]["description"] = (
                    "**Refused** by serve_rft (400 `unsupported_parameter`) unless absent"
                    + (f" or {served}" if served else "") + f": {why}."
                    + (f"\n\n{props[name]['description']}" if props[name].get("description") else ""))
            if marked:
                first = marked[0]  # the answer's message as parse_request (openai_request.py) words it
                error = ApiError(400, f"{first} is not supported by this service: {refused[first][1]}", first,
                                 code="unsupported_parameter").body()
                response = op.setdefault("responses", {}).setdefault("400", {})
                response["description"] = ("A field the service refuses (marked **Refused**), an unknown field, "
                                           "a wrong type or a field over its size bound")
                response.setdefault("content", {}).setdefault("application/json", {"schema": {}})["examples"] = {
                    "a refused field": {"value": error}}
    for path, methods in examples.items():
        for method in methods:
            if method not in doc["paths"].get(path, {}):
                log.warning("docs/reference/http_examples.yaml: %s %s is not a route of openapi.json",
                            method.upper(), path)
    return doc


def _cell(text: str) -> str:
    """``text`` fit for one table cell: one line, its ``|`` escaped."""
    return text.replace("\n", " ").replace("|", "\\|")
