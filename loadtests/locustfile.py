"""Locust users for serve_rft: chat (streaming and not, mixed prompt and answer lengths, `n`) and
reward posting (rewards arrive after a random delay; a share never arrives).

Headless run against a running service (duration, user count, spawn rate, CSV + JSON results):

    .venv/bin/locust -f loadtests/locustfile.py --headless -u 8 -r 4 -t 60s \
        --host http://127.0.0.1:8000 --csv runs/locust --json-file runs/locust \
        --max-fail-ratio 0 --max-p99-s 10

CI smoke run (tests/integration/test_loadtest_smoke.py): a few users for tens of seconds with
``--max-fail-ratio 0``. Capacity: `loadtests/ramp.py` (same users, users ramped in steps until
throughput stops growing). Rolling syncs: benchmarks/zero_downtime.py runs these users at a fixed
rate (``--rate``) while versions roll.

User classes (weights): `ChatUser` 3 (non-streaming, n in {1, 2, 4}), `StreamUser` 1 (streaming,
usage included), `RewardUser` exactly one (posts the rewards of every answered choice after
0.2-2 s; ``--reward-skip`` of them never).

Options (each also an environment variable): ``--rate`` requests/s per chat user (constant
throughput; default 0: as fast as answered, 0-0.5 s think time), ``--reward-skip``,
``--request-log`` a JSONL file with one line per request (start, seconds, name, ok, status),
``--max-fail-ratio`` / ``--max-p99-s`` pass/fail thresholds (exit code 1 on a breach),
``--api-key`` an admin key (it chats and posts rewards) for a service with API keys on.
"""

from __future__ import annotations

import json
import random
import time
import heapq
import itertools

from locust import HttpUser, between, constant_throughput, events, task

SHORT = ["Say something nice.", "Name an animal.", "Hi!", "Describe the sea."]
LONG_WORDS = ("the quick brown fox jumps over a lazy dog while the sea keeps moving under a grey sky "
              "and a story about an animal begins to unfold").split()
ANSWER_LENGTHS = [8, 16, 32, 64]

_due: list[tuple[float, int, dict]] = []  # heap of (monotonic time the reward is due, tie-break, body)
_seq = itertools.count()
_log_file = None


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    g = parser.add_argument_group("serve_rft")
    g.add_argument("--rate", type=float, default=0.0, env_var="SERVE_RFT_RATE",
                   help="Requests/s per chat user (0: as fast as answered).")
    g.add_argument("--reward-skip", type=float, default=0.1, env_var="SERVE_RFT_REWARD_SKIP",
                   help="Share of answers never rewarded.")
    g.add_argument("--request-log", default="", env_var="SERVE_RFT_REQUEST_LOG",
                   help="JSONL file: one line per request.")
    g.add_argument("--max-fail-ratio", type=float, default=None, env_var="SERVE_RFT_MAX_FAIL_RATIO",
                   help="Exit 1 if the share of failed requests is above this.")
    g.add_argument("--max-p99-s", type=float, default=None, env_var="SERVE_RFT_MAX_P99_S",
                   help="Exit 1 if the p99 response time (all requests) is above this, s.")
    g.add_argument("--api-key", default="", env_var="SERVE_RFT_API_KEY",
                   help="Bearer key (an admin key: chats and posts rewards).")


@events.init.add_listener
def _init(environment, **_kw) -> None:
    global _log_file
    opts = environment.parsed_options
    if opts is not None and opts.request_log:
        _log_file = open(opts.request_log, "a", buffering=1)


def _opts(user):
    return user.environment.parsed_options


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
    """Set exit code 1 when a threshold is breached (and say which)."""
    opts = environment.parsed_options
    stats = environment.stats.total
    if opts is None:
        return
    if opts.max_fail_ratio is not None and stats.num_requests and stats.fail_ratio > opts.max_fail_ratio:
        print(f"THRESHOLD BREACHED: fail ratio {stats.fail_ratio:.4f} > {opts.max_fail_ratio}")
        environment.process_exit_code = 1
    if opts.max_p99_s is not None:
        p99 = stats.get_response_time_percentile(0.99) / 1000.0
        if p99 > opts.max_p99_s:
            print(f"THRESHOLD BREACHED: p99 {p99:.3f} s > {opts.max_p99_s} s")
            environment.process_exit_code = 1
    if opts.max_fail_ratio is not None and stats.num_requests == 0:
        print("THRESHOLD BREACHED: no request was made")
        environment.process_exit_code = 1


def vowel_share(text: str) -> float:
    """The reward rule of the demo task: the share of vowels in the answer."""
    return sum(c in "aeiou" for c in text) / len(text) if text else 0.0


def _prompt() -> str:
    """Mixed prompt lengths: mostly short, a quarter 40-120 words."""
    if random.random() < 0.75:
        return random.choice(SHORT)
    return " ".join(random.choices(LONG_WORDS, k=random.randint(40, 120)))


def schedule_rewards(user, cid: str, texts: list[str]) -> None:
    """Queue the rewards of one answer for `RewardUser` (after 0.2-2 s; some never)."""
    if random.random() < _opts(user).reward_skip:
        return
    body = {"rewards": [{"completion_id": cid, "choice_index": i, "reward": vowel_share(t)}
                        for i, t in enumerate(texts)]}
    heapq.heappush(_due, (time.monotonic() + random.uniform(0.2, 2.0), next(_seq), body))


class _ServeRftUser(HttpUser):
    abstract = True

    def wait_time(self):
        rate = _opts(self).rate
        return (constant_throughput(rate) if rate > 0 else between(0.0, 0.5))(self)

    def on_start(self) -> None:
        if _opts(self).api_key:
            self.client.headers["Authorization"] = f"Bearer {_opts(self).api_key}"


class ChatUser(_ServeRftUser):
    """Non-streaming chat: n in {1, 1, 2, 4}, answer lengths 8-64 tokens, mixed prompts."""

    weight = 3

    @task
    def chat(self) -> None:
        n = random.choice([1, 1, 2, 4])
        body = {"model": "serve-rft", "messages": [{"role": "user", "content": _prompt()}],
                "max_tokens": random.choice(ANSWER_LENGTHS), "n": n}
        with self.client.post("/v1/chat/completions", json=body, name="chat", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")
                return
            data = r.json()
            if len(data.get("choices", [])) != n:
                r.failure(f"{len(data.get('choices', []))} choices, asked {n}")
                return
            schedule_rewards(self, data["id"], [c["message"]["content"] for c in data["choices"]])


class StreamUser(_ServeRftUser):
    """Streaming chat (SSE) with usage: fails on an in-band error or a stream without [DONE]."""

    weight = 1

    @task
    def chat_stream(self) -> None:
        body = {"model": "serve-rft", "messages": [{"role": "user", "content": _prompt()}],
                "max_tokens": random.choice(ANSWER_LENGTHS), "stream": True,
                "stream_options": {"include_usage": True}}
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
            schedule_rewards(self, cid, [text])


class RewardUser(_ServeRftUser):
    """Exactly one: posts queued rewards when they fall due."""

    fixed_count = 1

    def wait_time(self):
        return 0.05

    @task
    def post_due(self) -> None:
        now = time.monotonic()
        while _due and _due[0][0] <= now:
            _, _, body = heapq.heappop(_due)
            with self.client.post("/v1/rewards", json=body, name="rewards", catch_response=True) as r:
                if r.status_code != 200:
                    r.failure(f"{r.status_code}: {r.text[:200]}")
