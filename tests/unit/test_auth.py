"""API key scopes: every route of the replica's app x every kind of key (the decision of
`ApiKeys.check`, and over HTTP through the app's own dependency for the document routes); the
stack test runs the same over a live service (tests/integration/test_stack_keep.py)."""

import pytest

from serve_rft.buffer.quota import key_identity
from serve_rft.explorer.http.auth import ADMIN, INFERENCE, OPEN, REWARDS, ApiKeys, Identity, required_scope
from serve_rft.explorer.http.protocol import ApiError

KEYS = ApiKeys(["inf"], ["adm"], ["rew"])
HEADERS = {"none": None, "empty bearer": "Bearer", "basic": "Basic adm", "unknown": "Bearer nope",
           "prefix of a key": "Bearer ad", "inference": "Bearer inf", "reward": "Bearer rew", "admin": "Bearer adm"}
GRANTS = {"inference": {INFERENCE}, "reward": {REWARDS}, "admin": {INFERENCE, REWARDS, ADMIN}}


def _answer(keys: ApiKeys, path: str, header: str | None) -> int:
    try:
        keys.check(path, header)
    except ApiError as e:
        code = e.body()["error"]["code"]
        assert (e.status, code) in ((401, "invalid_api_key"), (403, "insufficient_scope")), e.body()
        return e.status
    return 200


def _routes() -> list[str]:
    """Every path the replica's app serves (the replica module registers its routes on it)."""
    import serve_rft.explorer.replica  # noqa: F401
    from serve_rft.explorer.http.app import app

    return [r.path.replace("{completion_id}", "x").replace("{replica_id}", "r").replace("{model_id:path}", "m")
            for r in app.routes]


EXPECTED_SCOPE = {
    "/health": None,
    "/v1/chat/completions": INFERENCE, "/v1/completions": INFERENCE, "/v1/responses": INFERENCE,
    "/v1/models": INFERENCE, "/v1/models/m": INFERENCE,
    "/v1/rewards": REWARDS, "/v1/experiences/x": REWARDS,
    "/v1/status": ADMIN, "/v1/sync/events": ADMIN, "/v1/sync/rollout": ADMIN,
    "/v1/sync/pin": ADMIN, "/v1/sync/rollback": ADMIN, "/v1/sync/promotion": ADMIN,
    "/v1/sync/replicas/r/drain": ADMIN, "/openapi.json": ADMIN, "/docs": ADMIN, "/redoc": ADMIN,
}


def test_every_route_has_the_expected_scope():
    """A new route is admin-only until it is listed here (and in auth's table) on purpose."""
    routes = _routes()
    assert sorted(routes) == sorted(EXPECTED_SCOPE)
    assert {p: required_scope(p) for p in routes} == EXPECTED_SCOPE
    assert required_scope("/v1/anything-new") == ADMIN


@pytest.mark.parametrize("path", sorted(EXPECTED_SCOPE))
@pytest.mark.parametrize("kind", sorted(HEADERS))
def test_every_route_x_key_kind(path, kind):
    """No / malformed / unknown key: 401; a known key without the scope: 403; with it: allowed."""
    scope, header = EXPECTED_SCOPE[path], HEADERS[kind]
    if scope is None:
        expected = 200
    elif kind not in GRANTS:
        expected = 401
    else:
        expected = 200 if scope in GRANTS[kind] else 403
    assert _answer(KEYS, path, header) == expected


def test_scheme_is_case_insensitive_and_the_key_is_not():
    assert _answer(KEYS, "/v1/models", "bearer inf") == 200
    assert _answer(KEYS, "/v1/models", "Bearer INF") == 401


def test_a_key_in_two_lists_has_both_scopes():
    keys = ApiKeys(["both"], [], ["both"])
    assert _answer(keys, "/v1/chat/completions", "Bearer both") == 200
    assert _answer(keys, "/v1/rewards", "Bearer both") == 200
    assert _answer(keys, "/v1/status", "Bearer both") == 403


def test_the_refusal_says_what_is_missing():
    with pytest.raises(ApiError) as e:
        KEYS.check("/v1/sync/rollback", "Bearer rew")
    assert e.value.status == 403 and "Missing scope: admin" in e.value.message
    with pytest.raises(ApiError) as e:
        KEYS.check("/v1/rewards", "Bearer inf")
    assert e.value.status == 403 and "reward or an admin key" in e.value.message


@pytest.mark.parametrize("kinds", [
    {"api_keys": []}, {"api_keys": ["", ""]},  # empty entries are no keys
])
def test_no_keys_means_open(kinds):
    keys = ApiKeys(kinds["api_keys"], [], [])
    assert not keys.enabled
    assert _answer(keys, "/v1/sync/rollback", None) == 200


def test_any_one_kind_turns_auth_on_for_every_route():
    for keys in (ApiKeys(["i"], []), ApiKeys([], ["a"]), ApiKeys([], [], ["r"])):
        assert keys.enabled
        assert _answer(keys, "/v1/sync/rollback", None) == 401
        assert _answer(keys, "/v1/chat/completions", None) == 401


def test_keys_come_from_the_environment(monkeypatch):
    from serve_rft.config import load_config

    monkeypatch.setenv("SERVE_RFT_API_KEYS", "a, b")
    monkeypatch.setenv("SERVE_RFT_ADMIN_KEYS", "c")
    monkeypatch.setenv("SERVE_RFT_REWARD_KEYS", "d,")
    cfg = load_config(None, [])
    assert (cfg.service.api_keys, cfg.service.admin_keys, cfg.service.reward_keys) == (["a", "b"], ["c"], ["d"])
    keys = ApiKeys.from_config(cfg.service)
    assert _answer(keys, "/v1/rewards", "Bearer d") == 200 and _answer(keys, "/v1/models", "Bearer d") == 403


@pytest.fixture
def client():
    """The replica's app over HTTP with its key check answered by `KEYS` (no Serve replica)."""
    from fastapi import Request
    from fastapi.testclient import TestClient

    from serve_rft.explorer.http import app as http

    def check(request: Request) -> None:
        KEYS.check(request.url.path, request.headers.get("authorization"))

    http.app.dependency_overrides[http.authorize] = check
    try:
        yield TestClient(http.app)
    finally:
        http.app.dependency_overrides.clear()


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_the_api_document_and_its_pages_take_the_admin_scope(client, path):
    assert client.get(path).status_code == 401
    r = client.get(path, headers={"Authorization": "Bearer inf"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    r = client.get(path, headers={"Authorization": "Bearer adm"})
    assert r.status_code == 200
    if path == "/openapi.json":
        assert "/v1/rewards" in r.json()["paths"]
    else:
        assert "/openapi.json" in r.text


def test_an_unauthenticated_operator_route_never_reaches_its_handler(client):
    """With keys on, ``POST /v1/sync/rollback`` with no key is 401 before its body is read."""
    r = client.post("/v1/sync/rollback", content=b"not json")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_reward_keys_read_experiences_and_inference_keys_do_not():
    """A grader reads the state of what it rewards (its own tenant's: the route answers 404 for
    another's); an inference key is refused the read."""
    assert _answer(KEYS, "/v1/experiences/chatcmpl-1", "Bearer rew") == 200
    assert _answer(KEYS, "/v1/experiences/chatcmpl-1", "Bearer inf") == 403
    assert required_scope("/v1/experiences/x/y") == ADMIN  # no route: not widened past the one path


TENANTS = ApiKeys(["inf"], ["adm"], ["rew"], {"alice": (["a-inf"], ["a-rew"]), "bob": (["b-inf"], [])})


@pytest.mark.parametrize("key, tenant, scopes", [
    ("inf", "default", {INFERENCE}), ("rew", "default", {REWARDS}),
    ("a-inf", "alice", {INFERENCE}), ("a-rew", "alice", {REWARDS}), ("b-inf", "bob", {INFERENCE}),
    ("adm", "default", {INFERENCE, REWARDS, ADMIN}),
])
def test_check_returns_the_callers_tenant_scopes_and_key(key, tenant, scopes):
    """The caller's ids are its key's own: ``owner`` is the key's digest, never the key."""
    path = "/v1/rewards" if REWARDS in scopes else "/v1/models"
    who = TENANTS.check(path, f"Bearer {key}")
    assert who == Identity(tenant, frozenset(scopes), key_identity(key))
    assert len(who.owner) == 32 and key not in who.owner
    assert who.admin == (ADMIN in scopes)


def test_who_reaches_which_tenants_completions():
    alice, admin = TENANTS.check("/v1/rewards", "Bearer a-rew"), TENANTS.check("/v1/rewards", "Bearer adm")
    assert alice.reaches("alice") and not alice.reaches("default") and not alice.reaches("bob")
    assert admin.reaches("alice") and admin.reaches("bob") and admin.reaches("default")
    assert not admin.reaches(None)  # an unknown completion is unknown to everyone
    assert alice.owner_filter == "alice" and admin.owner_filter is None
    assert TENANTS.check("/health", None) is OPEN
    assert ApiKeys([], []).check("/v1/rewards", None) is OPEN and OPEN.admin


def test_the_flat_lists_and_a_tenant_named_default_are_one_tenant():
    """Today's set-up (an inference key and a grader's reward key) keeps working together."""
    from serve_rft.config.service import ServiceConfig

    service = ServiceConfig(api_keys=["inf"], reward_keys=["rew"], tenants={
        "default": {"reward_keys": ["rew2"]}, "alice": {"api_keys": ["a-inf"], "reward_keys": ["a-rew"]}})
    keys = ApiKeys.from_config(service)
    assert {keys.check("/v1/rewards", f"Bearer {k}").tenant for k in ("rew", "rew2")} == {"default"}
    assert keys.check("/v1/models", "Bearer inf").tenant == "default"
    assert keys.check("/v1/rewards", "Bearer a-rew").tenant == "alice"
    assert service.has_keys and ServiceConfig(tenants={"t": {"api_keys": ["k"]}}).has_keys


@pytest.mark.parametrize("service", [
    {"api_keys": ["k"], "tenants": {"alice": {"api_keys": ["k"]}}},  # default and alice
    {"tenants": {"alice": {"reward_keys": ["k"]}, "bob": {"api_keys": ["k"]}}},  # two tenants
    {"admin_keys": ["k"], "reward_keys": ["k"]},  # an admin key is no tenant's
    {"admin_keys": ["k"], "tenants": {"alice": {"api_keys": ["k"]}}},
    {"tenants": {"a/b": {}}}, {"tenants": {"": {}}}, {"tenants": {"x" * 65: {}}},  # names go into keys
])
def test_a_key_with_two_owners_or_a_bad_tenant_name_is_a_config_error(service):
    from pydantic import ValidationError

    from serve_rft.config.service import ServiceConfig

    with pytest.raises(ValidationError) as e:
        ServiceConfig(**service)
    assert "'k'" not in str(e.value)  # a refused config never echoes a key
    if "tenants" in service and "admin_keys" not in service and any("k" in str(v) for v in service["tenants"].values()):
        with pytest.raises(ValueError):
            ApiKeys(service.get("api_keys", []), [], [], {n: (t.get("api_keys", []), t.get("reward_keys", []))
                                                          for n, t in service["tenants"].items()})


def test_inference_and_reward_scopes_of_one_tenant_may_share_a_key():
    keys = ApiKeys([], [], [], {"alice": (["both"], ["both"])})
    assert keys.check("/v1/rewards", "Bearer both") == Identity("alice", frozenset({INFERENCE, REWARDS}),
                                                                key_identity("both"))


def test_tenants_come_from_the_environment(monkeypatch):
    from serve_rft.config import load_config

    monkeypatch.setenv("SERVE_RFT_TENANTS", '{"alice": {"api_keys": ["a1"], "reward_keys": ["a2"]}}')
    keys = ApiKeys.from_config(load_config(None, []).service)
    assert keys.check("/v1/rewards", "Bearer a2").tenant == "alice"
    assert _answer(keys, "/v1/models", "Bearer a2") == 403


def test_a_tenants_keys_alone_turn_auth_on_and_allow_exposure():
    from serve_rft.config.service import ServiceConfig, check_exposure

    service = ServiceConfig(tenants={"alice": {"reward_keys": ["a-rew"]}})
    assert check_exposure(service, "0.0.0.0") is None
    keys = ApiKeys.from_config(service)
    assert keys.enabled and _answer(keys, "/v1/chat/completions", None) == 401
