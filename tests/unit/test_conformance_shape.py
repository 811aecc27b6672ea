"""The JSON shape diff behind the vLLM conformance test (tests/support/conformance.py)."""

from tests.support.conformance import differences, shape


def test_shape_diff_finds_missing_and_mistyped_fields():
    ours = shape({"a": 1, "b": [{"c": "x"}], "extra": True, "opt": None})
    theirs = shape({"a": 2.5, "b": [{"c": "y", "d": 1}], "opt": {"z": 1}, "e": "s"})
    assert differences(ours, theirs) == ["$.b[].d: missing", "$.e: missing"]
    assert differences(shape({"a": "1"}), shape({"a": 1})) == ["$.a: number expected, got str"]
    assert shape([{"a": None}, {"a": 1}]) == [{"a": "number"}]


def test_data_keyed_objects_compare_by_their_values_shape():
    ours = shape({"prompt_logprobs": [None, {"17": {"logprob": -1.0, "rank": 1}}]})
    theirs = shape({"prompt_logprobs": [None, {"750": {"logprob": -2.0, "rank": 3}, "231": {"logprob": -1.5}}]})
    assert ours == {"prompt_logprobs": [{"*": {"logprob": "number", "rank": "number"}}]}
    assert differences(ours, theirs) == []
    assert differences(shape({"prompt_logprobs": [{"1": {"rank": 1}}]}), theirs) == ["$.prompt_logprobs[].*.logprob: missing"]
