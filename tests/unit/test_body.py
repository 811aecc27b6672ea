"""Request bodies: every hostile body becomes a 4xx `ApiError`, never an exception."""

import asyncio

import pytest

from serve_rft.explorer.http.body import MAX_JSON_DEPTH, parse_json, read_body
from serve_rft.explorer.http.protocol import ApiError, RewardItem


@pytest.mark.parametrize("raw", [b"[" * 100_000, b"{\"a\": " * 70 + b"1" + b"}" * 70,
                                 b'{"seed": ' + b"9" * 5000 + b"}", b"{not json", b"\xff\xfe"])
def test_hostile_json_is_a_400(raw):
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400


def test_depth_at_the_bound_parses():
    expected: list = []
    for _ in range(MAX_JSON_DEPTH - 1):
        expected = [expected]
    assert parse_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) == expected


class _Req:
    """The two things `read_body` uses of a Starlette request."""

    def __init__(self, chunks, declared=None):
        self.headers = {"content-length": str(declared)} if declared is not None else {}
        self._chunks = chunks

    async def stream(self):
        for c in self._chunks:
            yield c


def test_the_size_bound_holds_while_streaming_and_on_the_declared_length():
    assert asyncio.run(read_body(_Req([b"ab", b"cd"]), max_bytes=4)) == b"abcd"
    for req in (_Req([b"abc", b"de"]), _Req([b"a"], declared=5)):
        with pytest.raises(ApiError) as e:
            asyncio.run(read_body(req, max_bytes=4))
        assert e.value.status == 413


def test_strict_types_and_vllms_seed_bound():
    from serve_rft.explorer.http.openai_request import parse_request

    base = {"messages": [{"role": "user", "content": "x"}]}
    for bad in ({"stream": "yes"}, {"seed": 2**64}, {"n": "2"}, {"logprobs": 1}, {"model": 5}, {"stop": ""},
                {"stop": ["a", ""]}):
        with pytest.raises(ApiError) as e:
            parse_request({**base, **bad}, "chat", max_n=16)
        assert e.value.status == 400 and e.value.param == next(iter(bad)), (bad, e.value.message)
    req, _ = parse_request({**base, "seed": 2**63 - 1, "temperature": 1}, "chat", max_n=16)
    assert req.seed == 2**63 - 1
    with pytest.raises(ValueError, match="finite"):
        RewardItem.model_validate({"completion_id": "c", "reward": 1.0, "info": {"x": float("nan")}})


@pytest.mark.parametrize("raw,param", [
    (b'{"user": "\\ud800"}', "user"),
    (b'{"a": {"b": ["ok", "x\\uDBFF"]}}', "a.b.1"),
    (b'{"a": {"\\udc00": 1}}', "a"),
    (b'"\\ud800"', None),
    ('{"user": "\\ud800"}'.encode("utf-16-le"), "user"),  # a UTF-16 body: escapes are not ASCII bytes
    ('{"user": "\\ud800"}'.encode("utf-32"), "user"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(raw, param):
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400 and e.value.param == param and "not valid Unicode" in e.value.message


@pytest.mark.parametrize("raw,value", [
    (b'{"a": "\\ud83d\\ude00"}', "\U0001F600"),  # a surrogate pair: one code point
    (b'{"a": "\\\\ud800"}', "\\ud800"),  # an escaped backslash: the six characters, no escape
    (b'{"a": "\\u00e9\\u4e2d"}', "\u00e9\u4e2d"),
    ('{"a": "\u00e9"}'.encode("utf-16"), "\u00e9"),
])
def test_valid_unicode_parses(raw, value):
    import json

    parsed = parse_json(raw)
    assert parsed == {"a": value}
    assert json.loads(json.dumps(parsed, ensure_ascii=False).encode("utf-8")) == {"a": value}  # stored and read back


@pytest.mark.parametrize("raw", [
    b'{"completion_id": "x\xed\xa0\x80", "reward": 1}',  # /v1/rewards: a raw UTF-8-encoded surrogate
    b'{"messages": [{"role": "user", "content": "hi"}], "group_id": "g\xed\xb0\x80"}',  # a chat's group_id
    b'{"conversation_id": "\xed\xbf\xbf"}',
    '{"completion_id": "x'.encode("utf-16-le") + b"\x00\xd8" + '", "reward": 1}'.encode("utf-16-le"),
])
def test_raw_surrogate_bytes_are_a_400_not_text(raw):
    """Raw surrogate bytes (no ``\\u`` escape) are not valid UTF-8 / UTF-16: the body is refused
    before parsing, so no unencodable string reaches the store (redis-py would raise)."""
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400 and "not valid" in e.value.message and "UTF-" in e.value.message
