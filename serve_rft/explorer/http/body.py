"""Request bodies in, bounded: no body makes a replica answer 5xx or stall its event loop.

- size: ``Content-Length`` is checked first and the body is counted while it streams in, so a
  body over `MAX_BODY_BYTES` is refused (413) without being held whole;
- JSON: nesting deeper than `MAX_JSON_DEPTH` (a 100 KB run of ``[`` once raised RecursionError)
  and integers longer than `MAX_INT_DIGITS` digits (Python refuses to convert more than 4,300,
  and no field needs more than int64's 19) are refused (400) while parsing;
- text: a ``\\uD800``-``\\uDFFF`` escape that is not half of a surrogate pair parses (Python's json
  keeps it) but cannot be encoded as UTF-8, so neither stored nor answered; it is refused (400,
  ``param`` the dotted path of the string) before anything is generated (RFC 8259 §8.2: such
  strings are "unpredictable" to receivers); raw surrogate bytes (``ED A0 80``, no escape) are
  not text in the body's encoding: the body is decoded strictly before parsing and refused (400)
  (``json.loads`` of bytes would decode them with ``surrogatepass`` and keep them);
- ``NaN`` / ``Infinity`` parse (Python's json accepts them) and are refused by the field that
  receives them, with that field as ``param`` (a reward: 422; a sampling setting: 400);
- a body larger than `THREAD_PARSE_BYTES` is parsed on a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import Request

from serve_rft.explorer.http.protocol import ApiError

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 32
THREAD_PARSE_BYTES = 256 * 1024


async def read_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, at most ``max_bytes``.

    Raises:
        ApiError: 413 larger than ``max_bytes`` (declared or streamed).
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body is larger than {max_bytes} bytes", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body is larger than {max_bytes} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ApiError(400, f"request body has an integer of {len(text.lstrip('-'))} digits (at most "
                       f"{MAX_INT_DIGITS})", code="invalid_json")
    return int(text)


def _depth(obj: Any) -> int:
    """Nesting depth of parsed JSON, iteratively (no recursion limit)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:
                stack.extend((x, d + 1) for x in node if isinstance(x, (dict, list)))
    return deepest


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A ``\\uD800``-``\\uDFFF`` escape in a UTF-8 body: the only way a surrogate gets into its parsed
JSON (raw surrogate bytes are not valid UTF-8 and fail decoding)."""


def unencodable_text(obj: Any) -> str | None:
    """The dotted path (``messages.0.content``; a key: its object's path and the key) of the first
    string, key or value, in parsed JSON that is not encodable as UTF-8 (a lone surrogate); None
    if every string is. Iterative (no recursion limit)."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            here = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _encodes(key):
                return path or "(body)"
            if isinstance(value, str):
                if not _encodes(value):
                    return here
            elif isinstance(value, (dict, list)):
                stack.append((value, here))
    return "(body)" if isinstance(obj, str) and not _encodes(obj) else None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_json(raw: bytes) -> Any:
    """Parse a request body (module docstring for the bounds).

    Raises:
        ApiError: 400 bytes that are not text in the body's encoding (UTF-8, UTF-16 or UTF-32 as
            RFC 8259 §8.1 / `json.detect_encoding` tell; raw surrogate bytes included), not JSON,
            nested deeper than `MAX_JSON_DEPTH`, an oversized integer, a string that is not valid
            Unicode (a lone surrogate escape; ``param``: where).
    """
    encoding = json.detect_encoding(raw)
    try:  # strict: json.loads(bytes) would let raw surrogate bytes through (surrogatepass)
        text = raw.decode(encoding)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid {e.encoding.upper()} at byte {e.start}: {e.reason} "
                       "(a surrogate or other byte sequence that is not text)", code="invalid_json") from None
    try:
        obj = json.loads(text, parse_int=_int)
    except RecursionError:
        raise ApiError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep",
                       code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None  # vLLM's shape: no code
    if _depth(obj) > MAX_JSON_DEPTH:
        raise ApiError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")
    # only a surrogate escape puts one in a string (a UTF-16 / UTF-32 body: always look)
    if _SURROGATE_ESCAPE.search(raw) or encoding != "utf-8":
        where = unencodable_text(obj)
        if where is not None:
            raise ApiError(400, f"{where}: text is not valid Unicode (a lone surrogate escape such as "
                           "\\ud800 that is not half of a pair)", None if where == "(body)" else where,
                           code="invalid_json")
    return obj


async def read_json(request: Request, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """`read_body` then `parse_json` (on a thread when the body is large).

    Raises:
        ApiError: 413 too large, 400 not acceptable JSON.
    """
    raw = await read_body(request, max_bytes)
    if len(raw) > THREAD_PARSE_BYTES:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)
