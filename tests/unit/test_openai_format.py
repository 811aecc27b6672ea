from dataclasses import dataclass

from serve_rft.explorer import openai_format as fmt
from serve_rft.explorer.experience_log import build_experiences
from serve_rft.types import SamplingInfo


@dataclass
class LP:
    logprob: float
    rank: int
    decoded_token: str


@dataclass
class Span:
    version: str
    start: int
    end: int


@dataclass
class Out:
    index: int
    token_ids: list
    logprobs: list
    text: str
    finish_reason: str | None = None
    weight_versions: list | None = None
    stop_reason: int | str | None = None


def test_accumulates_deltas_logprobs_and_version_spans():
    acc = fmt.ChoiceAccumulator(0)
    acc.add(Out(0, [5], [{5: LP(-0.1, 1, "a"), 6: LP(-2.0, 2, "b")}], "a"), top_logprobs=2)
    entries = acc.add(Out(0, [7], [{7: LP(-3.0, 3, "c"), 5: LP(-0.2, 1, "a")}], "c", "length",
                          [Span("0", 0, 1), Span("1", 1, 2)]), top_logprobs=1)
    assert acc.token_ids == [5, 7] and acc.logprobs == [-0.1, -3.0] and acc.text == "ac"
    assert entries[0]["token"] == "c" and entries[0]["top_logprobs"][0]["token"] == "a"
    assert acc.spans(9) == [(0, 0, 1), (1, 1, 2)]
    exps = build_experiences("cid", "r", [1, 2], [acc], SamplingInfo(temperature=1, top_p=1, max_tokens=2),
                             0.0, 0)
    assert exps[0].min_version == 0 and exps[0].response_token_ids == [5, 7]
    body = fmt.chat_response("cid", "m", 0, 0, [acc], 2, want_logprobs=True)
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    assert body["system_fingerprint"] == "policy-v0"
    assert len(body["choices"][0]["logprobs"]["content"]) == 2


def test_spans_fall_back_to_the_replica_version():
    acc = fmt.ChoiceAccumulator(0)
    acc.add(Out(0, [5, 6], [{5: LP(-1, 1, "a")}, {6: LP(-1, 1, "b")}], "ab", "stop"), None)
    assert acc.spans(4) == [(4, 0, 2)]
