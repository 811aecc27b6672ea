"""A draining replica's admission: refuse only what HAProxy can re-send (`WeightSwap.admission`,
`serve_rft.explorer.http.ingress_mode.fits_a_retry`). A refusal HAProxy cannot re-send reaches the
client as a 503: a request failed because of a sync (CI once saw one for a 100 KB body)."""

from __future__ import annotations

import pytest

from serve_rft.explorer.http import ingress_mode
from serve_rft.explorer.http.ingress_mode import fits_a_retry, retry_capacity_bytes
from serve_rft.explorer.weight_swap import WeightSwap


@pytest.fixture
def behind_haproxy(monkeypatch):
    monkeypatch.setenv(ingress_mode.HAPROXY_FLAG, "1")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", "conn-failure empty-response 503\n option http-buffer-request")
    monkeypatch.delenv(ingress_mode.BUFSIZE_ENV, raising=False)


def swap() -> WeightSwap:
    return WeightSwap("r1", None, engine=None, sync=None, cfg=None, model_path="/m", explorer_step=lambda: 0)


def test_only_a_request_whole_in_half_haproxys_buffer_counts_as_re_sendable(behind_haproxy, monkeypatch):
    assert retry_capacity_bytes() == 8192
    assert fits_a_retry("7000", 1000) and fits_a_retry("7192", 1000)
    assert not fits_a_retry("7193", 1000)
    assert not fits_a_retry(None, 100)  # chunked: size unknown
    assert not fits_a_retry("-1", 100) and not fits_a_retry("1e3", 100)
    monkeypatch.setenv(ingress_mode.BUFSIZE_ENV, str(1 << 20))
    assert fits_a_retry("100000", 2000)


def test_a_sync_drain_refuses_small_requests_and_holds_large_ones(behind_haproxy):
    s = swap()
    assert s.admission(True) == "serve" and s.admission(False) == "serve"
    s.syncing, s.refuses = True, True  # granted a sync, another replica serves
    s.gate.clear()
    assert s.admission(True) == "refuse" and s.refused == 1
    assert s.admission(False) == "hold" and s.refused == 1  # not counted: nothing was refused
    s.refuses = False  # the last replica serving: everything waits
    assert s.admission(True) == "hold" and s.admission(False) == "hold"
    s.syncing = False
    s.gate.set()
    assert s.admission(True) == "serve" and s.admission(False) == "serve"


def test_an_operator_drain_serves_what_haproxy_could_not_re_send(behind_haproxy):
    s = swap()
    s.operator_drained = True
    assert s.admission(True) == "refuse"
    assert s.admission(False) == "serve"  # the gate is open: no weights are loading
    s.syncing = True
    s.gate.clear()
    assert s.admission(False) == "hold"


def test_a_broken_replica_refuses_everything(behind_haproxy):
    s = swap()
    s.broken = RuntimeError("load outlived its timeout")
    assert s.admission(True) == "refuse" and s.admission(False) == "refuse"


def test_a_request_haproxy_brings_back_is_not_refused_twice(behind_haproxy):
    """A sync's refusal re-sent to a peer that died (before the synchronizer knew) comes back on
    HAProxy's next retry with the same x-request-id: held until the weights are loaded, not refused
    into HAProxy's exhausted retries (CI once saw 274 such failures in a kill during a sync)."""
    s = swap()
    s.syncing, s.refuses = True, True
    s.gate.clear()
    assert s.admission(True, "req-1") == "refuse"
    assert s.admission(True, "req-2") == "refuse"
    assert s.admission(True, "req-1") == "hold" and s.refused == 2
    assert s.admission(True, None) == "refuse"  # no id (not through HAProxy): nothing to recognise
    s.syncing = False
    s.operator_drained = True  # an operator's drain: the gate is open, a returning request is served
    s.gate.set()
    assert s.admission(True, "req-3") == "refuse" and s.admission(True, "req-3") == "serve"


def test_the_refused_ids_are_bounded(behind_haproxy):
    from serve_rft.explorer.weight_swap import REFUSED_IDS_KEPT

    s = swap()
    s.syncing, s.refuses = True, True
    s.gate.clear()
    for i in range(REFUSED_IDS_KEPT + 10):
        assert s.admission(True, f"r{i}") == "refuse"
    assert len(s.refused_ids) == REFUSED_IDS_KEPT and "r0" not in s.refused_ids
    assert s.admission(True, f"r{REFUSED_IDS_KEPT + 9}") == "hold"
