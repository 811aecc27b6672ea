"""API key scopes (the middleware's decision; the stack test runs it over HTTP)."""

import pytest

from serve_rft.explorer.auth import ApiKeys
from serve_rft.explorer.protocol import ApiError


def _refused(keys: ApiKeys, path: str, header: str | None) -> bool:
    try:
        keys.check(path, header)
    except ApiError as e:
        assert e.status == 401 and e.body()["error"]["code"] == "invalid_api_key"
        return True
    return False


def test_no_keys_means_open():
    assert not _refused(ApiKeys([], []), "/v1/rewards", None)


@pytest.mark.parametrize("path,header,refused", [
    ("/health", None, False),
    ("/v1/chat/completions", None, True),
    ("/v1/chat/completions", "Bearer", True),
    ("/v1/chat/completions", "Basic inf", True),
    ("/v1/chat/completions", "Bearer nope", True),
    ("/v1/chat/completions", "Bearer inf", False),
    ("/v1/models", "bearer inf", False),
    ("/v1/chat/completions", "Bearer adm", False),
    ("/v1/rewards", "Bearer inf", True),
    ("/v1/status", "Bearer inf", True),
    ("/v1/experiences/x", "Bearer inf", True),
    ("/v1/rewards", "Bearer adm", False),
    ("/v1/status", "Bearer adm", False),
])
def test_scopes(path, header, refused):
    assert _refused(ApiKeys(["inf"], ["adm"]), path, header) is refused


def test_keys_come_from_the_environment(monkeypatch):
    from serve_rft.config import load_config

    monkeypatch.setenv("SERVE_RFT_API_KEYS", "a, b")
    monkeypatch.setenv("SERVE_RFT_ADMIN_KEYS", "c")
    cfg = load_config(None, [])
    assert (cfg.service.api_keys, cfg.service.admin_keys) == (["a", "b"], ["c"])
