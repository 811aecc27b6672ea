"""schemathesis's bodies for the inference routes, read as the routes read them (`parse_json`,
then `parse_request`) with no engine: whatever a client sends, the request is parsed or refused
with an `ApiError` (a 4xx), never another exception (a 500), and a /v1/responses input that is
parsed can be read by vLLM's renderer. The bodies come from the committed OpenAPI document
(``docs/reference/openapi.json``, what the app serves: `test_docs`), valid and invalid ones.
Randomized (`tests.support.fuzz`: ``SERVE_RFT_FUZZ_SEED``, printed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serve_rft.explorer.http.body import parse_json
from serve_rft.explorer.http.openai_request import parse_request
from serve_rft.explorer.http.protocol import ApiError
from tests.support.fuzz import fuzz_seed

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "responses"}


@pytest.mark.parametrize("path", sorted(KINDS))
def test_parse_request_refuses_with_a_4xx_or_parses_never_raises_anything_else(path):
    import schemathesis
    from hypothesis import HealthCheck, given, seed, settings
    from schemathesis import GenerationMode
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    chosen = fuzz_seed(f"parse_request over {path}")
    schema = schemathesis.openapi.from_dict(json.loads((ROOT / "docs/reference/openapi.json").read_text()))
    op = schema[path]["POST"]
    seen = {"parsed": 0, "refused": 0}
    examples = 60 if path == "/v1/responses" else 30  # its input check reads what vLLM's renderer reads
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @seed(chosen)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(op.as_strategy(generation_mode=mode))
        def read(case):
            raw = case.body if isinstance(case.body, bytes) else json.dumps(case.body, default=str).encode()
            try:
                req, _ = parse_request(parse_json(raw), KINDS[path], 8)
                seen["parsed"] += 1
            except ApiError as e:
                assert 400 <= e.status < 500, (e.status, e.message)
                seen["refused"] += 1
                return
            if path == "/v1/responses":  # what is served, vLLM's renderer can read
                construct_input_messages(request_instructions=req.instructions, request_input=req.input)
        read()
    print(path, seen)
    # schemathesis's completions bodies are all refused (the schema does not say a prompt is
    # required); chat and responses bodies reach vLLM's request models and the input check
    assert seen["refused"] and (seen["parsed"] or path == "/v1/completions"), seen
