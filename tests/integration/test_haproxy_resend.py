"""HAProxy's re-send, as the draining replica counts on it (`WeightSwap.admission`): Ray's HAProxy
binary with the retry line of Ray Serve's config template (``option redispatch 1``) and
serve_rft's `RETRY_ON` in its ``defaults`` (as Ray writes it), in front of a replica that is
loading weights (a real `WeightSwap` deciding each request) and a peer that was just killed
(nothing listens on its port). HAProxy re-sends the refusal to the dead peer, then brings it back
with the same `REQUEST_ID_HEADER`; the replica holds it instead of refusing it again, so the
client gets an answer, not HAProxy's 503 after its retries ran out (CI once saw 274 such failures
when a replica was killed while its peer synced). A client that sends the header itself does not
change the id HAProxy's re-sends carry."""

from __future__ import annotations

import http.server
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from serve_rft.buffer.redis_server import free_port
from serve_rft.explorer.http import ingress_mode
from serve_rft.explorer.http.ingress_mode import REQUEST_ID_HEADER, fits_a_retry, haproxy_request_id, head_bytes
from serve_rft.explorer.weight_swap import WeightSwap
from serve_rft.service.ingress import RETRY_ON

pytestmark = pytest.mark.integration

RAY_LINES = ["option redispatch 1", "retry-on {{ config.retry_on }}"]


def _ray_template() -> str:
    import ray.serve._private.haproxy_templates as t

    return Path(t.__file__).read_text()


def test_a_refusal_re_sent_to_a_dead_peer_comes_back_and_is_held(tmp_path, monkeypatch):
    from ray.serve._private.haproxy import get_haproxy_binary

    template = _ray_template()
    for line in RAY_LINES:  # the lines this test mirrors are Ray's own
        assert line in template, line
    monkeypatch.setenv(ingress_mode.HAPROXY_FLAG, "1")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", RETRY_ON)
    swap = WeightSwap("r1", None, engine=None, sync=None, cfg=None, model_path="/m", explorer_step=lambda: 0)
    swap.syncing, swap.refuses = True, True  # granted a sync while its peer (it thinks) serves
    swap.gate.clear()
    seen: list[tuple[str, str]] = []

    class Replica(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            rid = haproxy_request_id(self.headers.get_all(REQUEST_ID_HEADER) or [])
            head = head_bytes(self.command, self.path, self.headers.items())
            decision = swap.admission(fits_a_retry(str(len(body)), head), rid)
            seen.append((rid, decision))
            code = 503 if decision == "refuse" else 200  # held: answered once the weights are loaded
            self.send_response(code)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    replica_port, dead_port, front = free_port(), free_port(), free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", replica_port), Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text("\n".join([
        "global", "    maxconn 100",
        "defaults", "    mode http", "    timeout connect 5s", "    timeout client 30s", "    timeout server 30s",
        f"    {RAY_LINES[0]}", f"    retry-on {RETRY_ON}", "    balance leastconn",
        "frontend fe", f"    bind 127.0.0.1:{front}", "    default_backend be",
        "backend be", f"    server replica 127.0.0.1:{replica_port}", f"    server killed 127.0.0.1:{dead_port}", ""]))
    proc = subprocess.Popen([get_haproxy_binary(), "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{front}/", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, "haproxy did not start"
                time.sleep(0.1)
        seen.clear()
        codes = [httpx.post(f"http://127.0.0.1:{front}/v1/chat/completions", json={"messages": []},
                            headers={REQUEST_ID_HEADER: "same-for-all"} if i % 2 else {},
                            timeout=30).status_code for i in range(10)]
        assert codes == [200] * 10, (codes, seen)
        refused = {rid for rid, d in seen if d == "refuse"}
        held = {rid for rid, d in seen if d == "hold"}
        assert refused and refused == held, seen  # each refused once, then held on its return
        assert "same-for-all" not in refused, seen  # HAProxy's id, not the client's
        assert swap.refused == len(refused)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        server.shutdown()
