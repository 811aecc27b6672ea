"""Canary promotion and automatic rollback on the real stack (benchmarks/canary_run.py's
scenario: rewards are an oracle keyed by policy version; the first candidate's rewards collapse).

The bad candidate reaches one replica only and is rolled back by the synchronizer's verdict; its
canary returns to the incumbent; a later candidate is promoted and rolls everywhere; no request
fails. Also the operator's routes: pin, rollback to a named version, pause of promotions."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml

from benchmarks.canary_run import CANARY_OVERRIDES, scenario
from tests.support.load import Users, get_status
from tests.support.stack import stack_fixture
from tests.support.stack_checks import ADMIN

pytestmark = pytest.mark.integration


# on_reject=reset: after the rollback the trainer continues from the incumbent's weights
stack = stack_fixture("canary", [*CANARY_OVERRIDES, "synchronizer.canary.on_reject=reset"])


def pause(url: str, paused: bool) -> dict:
    """POST /v1/sync/promotion; the answer's JSON (asserted 200)."""
    r = httpx.post(f"{url}/v1/sync/promotion", json={"paused": paused}, headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_bad_candidate_is_rolled_back_and_a_good_one_promoted(stack):
    result = scenario(stack.url, ADMIN, timeout_s=900)
    assert result["done"], result
    assert result["requests_failed"] == 0, result["errors"]
    bad, good = result["bad"], result["good"]
    assert len(result["served"].get(str(bad), [])) <= 1, result["served"]  # only its canary served it
    decisions = {(v["version"], v["decision"]) for v in result["verdicts"]}
    assert (bad, "rollback") in decisions and (good, "promote") in decisions, result["verdicts"]
    kinds = [(e["kind"], e["version"]) for e in result["timeline"]]
    assert kinds.index(("rolled_back", bad)) < kinds.index(("promoted", good)), kinds
    ro = httpx.get(f"{stack.url}/v1/sync/rollout", headers=ADMIN).json()
    listed = {v["version"]: v for v in ro["versions"]}  # the newest 10 versions
    if bad in listed:
        assert listed[bad]["rejected"], listed[bad]
    else:  # absent only because it is older than every version listed
        assert bad < min(listed), (bad, sorted(listed))
    assert all(r["policy_version"] != bad for r in get_status(stack.url, ADMIN)["replicas"] if r["alive"])
    # the trainer took the incumbent's weights back, verified by the version's probe, and trained on
    trainer = get_status(stack.url, ADMIN)["trainer"]
    assert trainer["resets"] >= 1 and trainer["error"] is None, trainer
    reset = trainer["last_reset"]
    assert reset["version"] < bad and reset["probe_max_diff"] is not None and reset["probe_max_diff"] <= 1e-5, reset


def test_operator_pins_rolls_back_and_pauses(stack):
    """The operator's routes: a pin to v0 moves every replica there; a rollback to a version
    below the incumbent makes it the incumbent, rejects the one rolled back from, and every
    replica answers with it; pauses toggle (that a pause holds a candidate on its canary:
    `test_a_pause_holds_a_candidate_on_its_canary_and_a_resume_judges_it`).

    Shown to fail with the rollback skipped (`Rollout.rollback` returning before it changes
    anything): the answer still named the old incumbent (``assert ... 18 == 0``, a rollback from
    v18 to v0)."""
    u = stack.url
    ro = httpx.get(f"{u}/v1/sync/rollout", headers=ADMIN).json()
    incumbent = ro["incumbent"]
    assert httpx.post(f"{u}/v1/sync/pin", json={"version": 10**6}, headers=ADMIN).status_code == 409
    assert httpx.post(f"{u}/v1/sync/pin", json={"version": "x"}, headers=ADMIN).status_code == 400
    assert httpx.post(f"{u}/v1/sync/pin", json={"version": 0}, headers=ADMIN).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # every replica back on the initial weights
        st = get_status(u, ADMIN)
        if all(r["policy_version"] == 0 for r in st["replicas"] if r["alive"]):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"pin to v0 not applied: {st['replicas']}")
    assert httpx.post(f"{u}/v1/sync/pin", json={"version": None}, headers=ADMIN).status_code == 200
    # a rollback to an earlier version than the incumbent (the newest loadable one below it; the
    # initial weights, v0, are always loadable): it becomes the incumbent, every version above it
    # is rejected, the incumbent among them, and the replicas serve it, as their answers' version
    # header says (a version the trainer publishes after the rollback may roll as usual)
    assert incumbent > 0, ro  # the scenario promoted a version: there is one to roll back from
    ro = httpx.get(f"{u}/v1/sync/rollout", headers=ADMIN).json()
    earlier = max(v for v in ro["loadable"] if v < incumbent)
    r = httpx.post(f"{u}/v1/sync/rollback", json={"version": earlier}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["incumbent"] == earlier and incumbent in r.json()["rejected"], r.text
    rejected = set(r.json()["rejected"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        live = [r["policy_version"] for r in get_status(u, ADMIN)["replicas"] if r["alive"]]
        if earlier in live and not rejected & set(live):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"rollback to v{earlier} not applied: {live} (rejected {sorted(rejected)})")
    served = {int(httpx.post(f"{u}/v1/chat/completions", headers=ADMIN, timeout=120, json={
        "model": "serve-rft", "messages": [{"role": "user", "content": f"after rollback {k}"}],
        "max_tokens": 2}).headers["x-serve-rft-policy-version"]) for k in range(4)}
    assert earlier in served and not served & rejected, (earlier, served, sorted(rejected))
    assert pause(u, True)["promotion_paused"] and not pause(u, False)["promotion_paused"]
    assert httpx.post(f"{u}/v1/sync/replicas/nope/drain", json={"drained": True}, headers=ADMIN).status_code == 404
    kinds = {e["kind"] for e in httpx.get(f"{u}/v1/sync/events", headers=ADMIN).json()["events"]}
    assert {"pinned", "unpinned", "rollback", "promotion_paused", "promotion_resumed"} <= kinds


def test_a_pause_holds_a_candidate_on_its_canary_and_a_resume_judges_it(stack):
    """A pause stops the rollout: with promotions paused and traffic rewarded, the trainer's next
    version becomes the candidate on its one canary replica and stays there past the moment its
    verdict was due (window end + ``reward_wait_s``, when even an undecided canary is judged): no
    verdict, the incumbent unchanged, no other replica on it. A resume gets the candidate judged
    at the next decision.

    Shown to fail with the pause ignored (`Rollout.decide` not checking ``promotion_paused``):
    the held candidate, v1, was judged and promoted while paused, and by its due time the
    rollout had moved on (incumbent v18, candidate v35: ``assert (True and 35 == 1)``)."""
    u = stack.url
    rollout = lambda: httpx.get(f"{u}/v1/sync/rollout", headers=ADMIN, timeout=30).json()  # noqa: E731
    canary = yaml.safe_load(next(o for o in CANARY_OVERRIDES if o.startswith("synchronizer.canary=")).split("=", 1)[1])
    assert pause(u, True)["promotion_paused"]
    try:
        before = rollout()
        with Users(u, users=2) as users:
            deadline = time.monotonic() + 300
            while (ro := rollout())["canary_window"] is None or ro["candidate"] in (None, before["incumbent"]):
                assert time.monotonic() < deadline, f"no candidate in 300 s: {ro}"
                time.sleep(0.5)
            candidate, end = ro["candidate"], ro["canary_window"][1]
            due = end + canary["reward_wait_s"] + 3.0  # every verdict comes by then, undecided too
            while time.time() < due:
                time.sleep(1)
            held = rollout()
            live = [r["policy_version"] for r in get_status(u, ADMIN)["replicas"] if r["alive"]]
            assert users.chats and not [c for c in users.chats if not c["ok"]], users.chats[-3:]
        assert held["promotion_paused"] and held["candidate"] == candidate, held
        assert held["incumbent"] == before["incumbent"], (before["incumbent"], held["incumbent"])
        assert [v for v in held["verdicts"] if v["version"] == candidate] == [], held["verdicts"]
        assert 1 <= live.count(candidate) <= canary["replicas"] and before["incumbent"] in live, (candidate, live)
        assert users.accepted, "no reward was accepted"
    finally:
        resumed = pause(u, False)
    assert not resumed["promotion_paused"]
    deadline = time.monotonic() + 60
    while True:
        ro = rollout()
        if [v for v in ro["verdicts"] if v["version"] == candidate]:
            break
        assert time.monotonic() < deadline, f"v{candidate} not judged 60 s after the resume: {ro}"
        time.sleep(0.5)


def test_a_real_prometheus_scrapes_the_stack_and_every_dashboard_query_and_alert_reads_data(stack, tmp_path):
    """Debian's Prometheus, started here with the shipped scrape config (pointed at this
    stack's metrics port, every 3 s) and alert rules, scrapes the stack after the canary ran
    (verdicts, arms, syncs exist). After a little
    traffic of every kind the dashboard shows (chat, streamed chat, a refused request, a
    `store: false` request, a reward): every dashboard query returns data, with the labels it
    groups by; every alert expression is accepted, every series it reads has data, and every rule
    evaluates without error; only the series in `tests.support.prometheus.NEEDS_AN_EVENT` may be
    absent, each for its reason. Checked after the trainer has not stepped for 25 s, longer than
    Ray keeps a gauge nobody sets again: fails with the gauges not held
    (`serve_rft.observability.held.REFRESH_S` set past the test's length), the trainer's
    gauges without data."""
    import shutil

    from tests.support.prometheus import NOT_INSTALLED, check_pack, running_prometheus

    assert shutil.which("prometheus"), NOT_INSTALLED
    assert stack.metrics_url
    with running_prometheus(stack.metrics_url, tmp_path) as prom:
        u, lines = stack.url, 0
        replicas = len(get_status(u, headers=ADMIN)["replicas"])

        def traffic(k: int) -> None:
            """Chat, streamed chat, a `store: false` chat, a refused request, a reward."""
            nonlocal lines
            chat = {"model": "serve-rft", "messages": [{"role": "user", "content": f"prometheus {k}"}],
                    "max_tokens": 4}
            r = httpx.post(f"{u}/v1/chat/completions", headers=ADMIN, timeout=120, json=chat)
            assert r.status_code == 200, r.text
            httpx.post(f"{u}/v1/rewards", headers=ADMIN, timeout=60, json={"completion_id": r.json()["id"], "reward": 1.0})
            with httpx.stream("POST", f"{u}/v1/chat/completions", headers=ADMIN, timeout=120,
                              json={**chat, "stream": True}) as streamed:
                lines += sum(1 for _ in streamed.iter_lines())
            assert httpx.post(f"{u}/v1/chat/completions", headers=ADMIN, timeout=120,
                              json={**chat, "store": False}).status_code == 200
            assert httpx.post(f"{u}/v1/chat/completions", headers=ADMIN, timeout=60,
                              json={**chat, "messages": []}).status_code == 400

        # two waves: the first creates each replica's request series (a series' first sample is not
        # an increase, and HAProxy may send the next request to the other replica), the second,
        # once Prometheus has scraped them (Ray's agent exports every 10 s), moves them inside its window
        def every_replica_streamed():
            traffic(0)
            return prom.query(f"count(ray_serve_rft_time_to_first_token_seconds_count) >= {replicas}")
        prom.wait_for("every replica's streamed-request series in Prometheus", every_replica_streamed, 120)
        for k in range(2 * replicas):
            traffic(k + 1)
        assert lines
        prom.wait_for("the second wave in Prometheus", lambda: prom.query(
            "sum(increase(ray_serve_rft_time_to_first_token_seconds_count[2m])) > 0"))
        # then no step for longer than Ray keeps a gauge nobody sets again (two export intervals,
        # 20 s): the trainer's gauges must still have data
        quiet, last, since = 25.0, None, time.monotonic()
        deadline = since + 180
        while time.monotonic() - since < quiet:
            step = get_status(u, headers=ADMIN)["trainer"]["last_step"].get("step")
            if step != last:
                last, since = step, time.monotonic()
            assert time.monotonic() < deadline, f"the trainer kept stepping (step {last})"
            time.sleep(1)
        check_pack(prom)
