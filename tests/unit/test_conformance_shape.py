"""The JSON shape diff behind the vLLM conformance test (tests/integration/conformance.py)."""

from tests.integration.conformance import differences, shape


def test_shape_diff_finds_missing_and_mistyped_fields():
    ours = shape({"a": 1, "b": [{"c": "x"}], "extra": True, "opt": None})
    theirs = shape({"a": 2.5, "b": [{"c": "y", "d": 1}], "opt": {"z": 1}, "e": "s"})
    assert differences(ours, theirs) == ["$.b[].d: missing", "$.e: missing"]
    assert differences(shape({"a": "1"}), shape({"a": 1})) == ["$.a: number expected, got str"]
    assert shape([{"a": None}, {"a": 1}]) == [{"a": "number"}]
