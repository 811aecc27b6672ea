"""Held gauges (`serve_rft.observability.held`): Ray exports a gauge only in the interval after it
was set, so each series is set again with its last value until it is forgotten."""

from __future__ import annotations

from ray.util import metrics

from serve_rft.observability import held


def test_every_series_is_set_again_with_its_last_value_until_forgotten(monkeypatch):
    recorded = []
    monkeypatch.setattr(metrics.Gauge, "_record", lambda self, value, tags=None: recorded.append(
        (self._name, value, dict(tags or {}))))
    gauge = held.Gauge("serve_rft_test_held", description="a test gauge", tag_keys=("replica",))
    gauge.set(3.0, tags={"replica": "a"})
    gauge.set(4.0, tags={"replica": "a"})
    gauge.set(1.0, tags={"replica": "b"})
    recorded.clear()
    assert held.refresh() >= 2
    mine = [r for r in recorded if r[0] == "serve_rft_test_held"]
    assert ("serve_rft_test_held", 4.0, {"replica": "a"}) in mine and ("serve_rft_test_held", 1.0, {"replica": "b"}) in mine
    assert ("serve_rft_test_held", 3.0, {"replica": "a"}) not in mine  # the last value only
    gauge.forget({"replica": "b"})
    recorded.clear()
    held.refresh()
    mine = [r for r in recorded if r[0] == "serve_rft_test_held"]
    assert mine and all(tags == {"replica": "a"} for _, _, tags in mine)
    assert held._thread is not None and held._thread.daemon  # the process's refresh thread runs
    gauge.forget({"replica": "a"})


def test_the_synchronizer_forgets_the_series_of_a_replica_that_left(monkeypatch):
    """SyncMetrics.refresh holds each replica's state and version while it is in the state, and
    stops holding them once it left (its series then ages out of Prometheus)."""
    from serve_rft.observability.sync_metrics import SyncMetrics

    metrics_ = SyncMetrics("checkpoint")
    forgotten = []
    monkeypatch.setattr(metrics_.replica_version, "forget", lambda tags=None: forgotten.append(tags))
    monkeypatch.setattr(metrics.Gauge, "_record", lambda self, value, tags=None: None)

    class State:  # the fields SyncMetrics.refresh reads
        def __init__(self, replicas):
            from types import SimpleNamespace

            from serve_rft.types import ComponentState

            self.replicas = {r: SimpleNamespace(replica_id=r, state=ComponentState.RUNNING, policy_version=1)
                             for r in replicas}
            self.rollout = SimpleNamespace(pinned=None, lag_open={})
            self.cfg = SimpleNamespace(max_version_lag_s=None)
            self.incumbent, self.candidate, self.trainer_state = 1, None, ComponentState.RUNNING
            self.members = SimpleNamespace(n_live=len(replicas))
            self.versions = SimpleNamespace(by_version={})

        def latest_version(self):
            return 1

        def serving(self):
            return len(self.replicas)

    metrics_.refresh(State(["r1", "r2"]))
    assert forgotten == []
    metrics_.refresh(State(["r2"]))
    assert forgotten == [{"replica": "r1"}]


def test_vllms_engine_gauges_are_held_too():
    """The replicas' vLLM stat logger (`held_stat_logger`) makes its gauges held ones, so an idle
    engine's queue and KV-cache gauges keep their last value as vLLM's own server keeps them."""
    from serve_rft.explorer.engine.engine_args import held_stat_logger

    logger_cls = held_stat_logger()
    assert logger_cls.__mro__[1].__name__ == "RayPrometheusStatLogger"
    gauge = logger_cls._gauge_cls("vllm:num_requests_running", documentation="running", labelnames=["model_name"])
    assert isinstance(gauge.metric, held.Gauge) and gauge.metric._name == "vllm_num_requests_running"  # as vLLM names it for Ray
