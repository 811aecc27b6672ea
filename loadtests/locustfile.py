"""Locust users for serve_rft: chat (streaming and not) and delayed reward posting.

Headless smoke run (30 s, 4 users) against a running service:

    .venv/bin/locust -f loadtests/locustfile.py --headless -u 4 -r 2 -t 30s \
        --host http://127.0.0.1:8000 --csv runs/locust

Each chat response's rewards are posted by the same user after a random delay (0.2-2 s); a
share of them (``REWARD_SKIP``) is never rewarded, as with real users.

Options (environment): ``SERVE_RFT_RATE`` requests/s per user (constant throughput; default:
as fast as the server answers, with 0-0.5 s think time), ``SERVE_RFT_REQUEST_LOG`` a JSONL file
that gets one line per request (start, seconds, name, ok, status), ``SERVE_RFT_MAX_FAIL_RATIO``
and ``SERVE_RFT_MAX_P99_S``: pass/fail thresholds checked at the end (exit code 1 on a breach),
``SERVE_RFT_API_KEY`` an admin key (it chats and posts rewards) for a service with API keys on.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, constant_throughput, events, task

REWARD_SKIP = float(os.environ.get("SERVE_RFT_REWARD_SKIP", "0.1"))
RATE = float(os.environ.get("SERVE_RFT_RATE", "0"))
REQUEST_LOG = os.environ.get("SERVE_RFT_REQUEST_LOG")
API_KEY = os.environ.get("SERVE_RFT_API_KEY")
_log_file = open(REQUEST_LOG, "a", buffering=1) if REQUEST_LOG else None


@events.request.add_listener
def _log_request(request_type, name, response_time, response_length, response=None, exception=None,
                 start_time=None, **_kw):
    if _log_file is None:
        return
    status = getattr(response, "status_code", None)
    _log_file.write(json.dumps({"start": start_time, "seconds": response_time / 1000.0, "name": name,
                                "ok": exception is None, "status": status,
                                "error": str(exception)[:200] if exception else None}) + "\n")


@events.quitting.add_listener
def _thresholds(environment, **_kw):
    stats = environment.stats.total
    max_fail = os.environ.get("SERVE_RFT_MAX_FAIL_RATIO")
    max_p99 = os.environ.get("SERVE_RFT_MAX_P99_S")
    if max_fail is not None and stats.num_requests and stats.fail_ratio > float(max_fail):
        environment.process_exit_code = 1
    if max_p99 is not None and stats.get_response_time_percentile(0.99) / 1000.0 > float(max_p99):
        environment.process_exit_code = 1
PROMPTS = ["Say something nice.", "Tell me a story.", "Describe the sea.", "Name an animal."]


def vowel_share(text: str) -> float:
    return sum(c in "aeiou" for c in text) / len(text) if text else 0.0


class ChatUser(HttpUser):
    wait_time = constant_throughput(RATE) if RATE > 0 else between(0.0, 0.5)

    def on_start(self) -> None:
        self.due: list[tuple[float, dict]] = []
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    def _post_due_rewards(self) -> None:
        now = time.monotonic()
        ready = [b for t, b in self.due if t <= now]
        self.due = [(t, b) for t, b in self.due if t > now]
        for body in ready:
            self.client.post("/v1/rewards", json=body, name="/v1/rewards")

    def _schedule(self, cid: str, texts: list[str]) -> None:
        if random.random() < REWARD_SKIP:
            return
        body = {"rewards": [{"completion_id": cid, "choice_index": i, "reward": vowel_share(t)}
                            for i, t in enumerate(texts)]}
        self.due.append((time.monotonic() + random.uniform(0.2, 2.0), body))

    @task(3)
    def chat(self) -> None:
        n = random.choice([1, 1, 2, 4])
        body = {"model": "serve-rft", "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
                "max_tokens": random.choice([8, 16, 32]), "n": n}
        with self.client.post("/v1/chat/completions", json=body, name="chat", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")
                return
            data = r.json()
            self._schedule(data["id"], [c["message"]["content"] for c in data["choices"]])
        self._post_due_rewards()

    @task(1)
    def chat_stream(self) -> None:
        body = {"model": "serve-rft", "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
                "max_tokens": 16, "stream": True}
        with self.client.post("/v1/chat/completions", json=body, name="chat_stream", stream=True,
                              catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}")
                return
            text, cid, done = "", None, False
            for line in r.iter_lines():
                if not line:
                    continue
                payload = line.decode()[len("data: "):]
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    r.failure(chunk["error"]["message"])
                    return
                cid = chunk["id"]
                for ch in chunk["choices"]:
                    text += ch["delta"].get("content") or ""
            if not done:
                r.failure("stream ended without [DONE]")
                return
            self._schedule(cid, [text])
        self._post_due_rewards()
