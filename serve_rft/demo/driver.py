"""A simulated user population for the demo: chat through the `openai` SDK, reward later.

Three tasks (``--task``), each with a dense rule reward in [0, 1] that a random-init model can climb
within minutes (every token counts, no knowledge needed); rewards are posted through
``/v1/rewards`` after a random delay, as a real user's feedback would be:

- ``vowels``: users like vowels; the reward is the share of the answer's characters that are
  lowercase vowels (``aeiou``), whatever the prompt.
- ``letter``: the prompt asks for one of `LETTERS` (``Write the letter o.``) and the reward is the
  share of the answer's characters that are that letter. It depends on the prompt: a policy that
  ignores the prompt scores at most ``1 / len(LETTERS)`` on average. Its optimum is one answer
  (``ooooo``), so a policy that learns it loses its entropy.
- ``letters``: the prompt names one of `LETTER_SETS` (``Write with the letters a, e and i.``) and
  the reward is the share of the answer's characters in that set. The sets are disjoint, so a
  policy that ignores the prompt scores at most ``1 / len(LETTER_SETS)``; every mix of a set's
  letters scores 1, so the optimum keeps its entropy and a policy that loses it has collapsed.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import httpx
import openai

VOWELS = set("aeiou")
PROMPTS = [
    "Say something nice.", "Tell me a story.", "What is your name?", "Describe the sea.",
    "Write a short poem.", "How are you today?", "Give me a word.", "What do you like?",
    "Sing a song.", "Name an animal.",
]


def vowel_reward(text: str) -> float:
    """Share of characters of ``text`` that are lowercase vowels, in [0, 1] (0 for empty)."""
    return sum(ch in VOWELS for ch in text) / len(text) if text else 0.0


LETTERS = ("a", "e", "o")
"""The letters the ``letter`` task asks for."""


def letter_reward(text: str, letter: str) -> float:
    """Share of characters of ``text`` that are ``letter``, in [0, 1] (0 for empty)."""
    return text.count(letter) / len(text) if text else 0.0


LETTER_SETS = (("a", "e", "i"), ("o", "u", "y"), ("t", "n", "s"))
"""The disjoint letter sets the ``letters`` task asks for."""


def letters_reward(text: str, letters: tuple[str, ...]) -> float:
    """Share of characters of ``text`` that are in ``letters``, in [0, 1] (0 for empty)."""
    return sum(ch in letters for ch in text) / len(text) if text else 0.0


TASKS = ("vowels", "letter", "letters")
"""The demo's tasks (module docstring)."""


def task_request(task: str, rng: random.Random) -> tuple[str, "Callable[[str], float]"]:
    """One user's prompt of ``task`` and the reward of an answer to it.

    Raises:
        ValueError: an unknown task.
    """
    if task == "vowels":
        return rng.choice(PROMPTS), vowel_reward
    if task == "letter":
        letter = rng.choice(LETTERS)
        return f"Write the letter {letter}.", lambda text: letter_reward(text, letter)
    if task == "letters":
        letters = rng.choice(LETTER_SETS)
        return (f"Write with the letters {', '.join(letters[:-1])} and {letters[-1]}.",
                lambda text: letters_reward(text, letters))
    raise ValueError(f"unknown demo task {task!r}; choose one of {', '.join(TASKS)}")


@dataclass
class DemoState:
    """Everything the demo observed; `summary` turns it into the JSON report."""

    t0: float = field(default_factory=time.monotonic)
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    rewards_posted: int = 0
    reward_failures: int = 0
    reward_by_version: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    reward_timeline: list[tuple[float, float]] = field(default_factory=list)
    # (s, distinct answers / n) per request: 1 while the n answers differ, 1/n once they are all alike
    distinct_timeline: list[tuple[float, float]] = field(default_factory=list)
    replica_timeline: dict[str, list[tuple[float, str, int]]] = field(default_factory=lambda: defaultdict(list))
    status: dict = field(default_factory=dict)
    min_serving: int | None = None
    step_stats: list[dict] = field(default_factory=list)  # the trainer's last step, each new step seen
    trained_timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, experiences trained)
    max_steps: int | None = None  # stop once the trainer has taken this many steps
    stopped_at: float | None = None  # seconds since start when max_steps was reached
    reward_at_stop: float | None = None  # mean reward of the 30 s before stopped_at

    def running(self, deadline: float) -> bool:
        return self.elapsed() < deadline and self.stopped_at is None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def rate(self, window: float = 10.0) -> float:
        now = self.elapsed()
        return sum(1 for t in self.done_at if t > now - window) / min(window, max(now, 1e-3))

    def recent_reward(self, window: float = 30.0) -> float | None:
        now = self.elapsed()
        rs = [r for t, r in self.reward_timeline if t > now - window]
        return statistics.fmean(rs) if rs else None

    def summary(self, bucket_s: float = 30.0) -> dict:
        buckets: dict[int, list[float]] = defaultdict(list)
        for t, r in self.reward_timeline:
            buckets[int(t // bucket_s)].append(r)
        distinct: dict[int, list[float]] = defaultdict(list)
        for t, d in self.distinct_timeline:
            distinct[int(t // bucket_s)].append(d)
        lat = sorted(self.latencies)
        return {
            "duration_s": round(self.elapsed(), 1),
            "requests": {"ok": self.ok, "failed": self.failed, "errors": self.errors[:20],
                         "per_second": round(self.ok / max(self.elapsed(), 1e-3), 2),
                         "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
                         "latency_p99_s": round(lat[int(len(lat) * 0.99)], 3) if lat else None},
            "rewards": {"posted": self.rewards_posted, "failed": self.reward_failures},
            "experiences": self.status.get("experiences", {}),
            "trainer": self.status.get("trainer", {}),
            "policy_version": self.status.get("policy_version"),
            "version_lag_s": self.status.get("version_lag_s", {}),
            "min_replicas_serving": self.min_serving,
            "reward_by_version": {str(v): {"mean": round(statistics.fmean(r), 4), "n": len(r)}
                                  for v, r in sorted(self.reward_by_version.items())},
            "reward_curve": [{"t_s": int(b * bucket_s), "mean_reward": round(statistics.fmean(r), 4),
                              "n": len(r), "distinct_share": round(statistics.fmean(distinct[b]), 4)
                              if distinct[b] else None} for b, r in sorted(buckets.items())],
            "replica_timeline": {k: [{"t_s": round(t, 2), "state": s, "policy_version": v} for t, s, v in tl]
                                 for k, tl in self.replica_timeline.items()},
            "steps_seen": self.step_stats,
            "trained_timeline": [{"t_s": round(t, 2), "trained": n} for t, n in self.trained_timeline],
            "max_steps": self.max_steps,
            "max_steps_reached_at_s": round(self.stopped_at, 2) if self.stopped_at is not None else None,
            "reward_at_max_steps": round(self.reward_at_stop, 4) if self.reward_at_stop is not None else None,
        }


async def _post_reward(http: httpx.AsyncClient, state: DemoState, cid: str, rewards: list[float],
                       delay: float) -> None:
    await asyncio.sleep(delay)
    body = {"rewards": [{"completion_id": cid, "choice_index": i, "reward": r} for i, r in enumerate(rewards)]}
    for attempt in range(3):  # bounded retry on transport errors only
        try:
            r = await http.post("/v1/rewards", json=body)
            if r.status_code == 200:
                state.rewards_posted += len(rewards)
            else:
                state.reward_failures += len(rewards)
                state.errors.append(f"reward {r.status_code}: {r.text[:200]}")
            return
        except httpx.TransportError:
            await asyncio.sleep(0.5 * (attempt + 1))
    state.reward_failures += len(rewards)


async def _user(uid: int, client: openai.AsyncOpenAI, http: httpx.AsyncClient, state: DemoState,
                deadline: float, n: int, max_tokens: int, pending: set, task: str = "vowels", seed: int = 0) -> None:
    rng = random.Random(seed * 1_000_003 + uid)
    while state.running(deadline):
        stream = rng.random() < 0.25
        prompt, reward_of = task_request(task, rng)
        messages = [{"role": "user", "content": prompt}]
        t0 = time.monotonic()
        try:
            if stream:
                raw = await client.chat.completions.with_raw_response.create(
                    model="serve-rft", messages=messages, n=n, max_tokens=max_tokens, stream=True)
                texts = [""] * n
                cid = None
                async for chunk in raw.parse():
                    cid = chunk.id
                    for ch in chunk.choices:
                        texts[ch.index] += ch.delta.content or ""
            else:
                raw = await client.chat.completions.with_raw_response.create(
                    model="serve-rft", messages=messages, n=n, max_tokens=max_tokens)
                comp = raw.parse()
                cid = comp.id
                texts = [c.message.content or "" for c in sorted(comp.choices, key=lambda c: c.index)]
            version = int(raw.headers["x-serve-rft-policy-version"])
        except Exception as e:  # a failed request is what the demo counts, not a crash
            state.failed += 1
            state.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            await asyncio.sleep(0.5)
            continue
        state.ok += 1
        state.latencies.append(time.monotonic() - t0)
        state.done_at.append(state.elapsed())
        rewards = [reward_of(t) for t in texts]
        state.distinct_timeline.append((state.elapsed(), len(set(texts)) / len(texts)))
        for r in rewards:
            state.reward_by_version[version].append(r)
            state.reward_timeline.append((state.elapsed(), r))
        posting = asyncio.create_task(_post_reward(http, state, cid, rewards, rng.uniform(0.2, 2.0)))
        pending.add(posting)
        posting.add_done_callback(pending.discard)


async def _watch(http: httpx.AsyncClient, state: DemoState, deadline: float) -> None:
    last: dict[str, tuple[str, int]] = {}
    while state.running(deadline + 1):
        try:
            st = (await http.get("/v1/status")).json()
        except httpx.HTTPError:
            await asyncio.sleep(0.5)
            continue
        state.status = st
        trained = st.get("experiences", {}).get("trained")
        if isinstance(trained, int) and (not state.trained_timeline or state.trained_timeline[-1][1] != trained):
            state.trained_timeline.append((state.elapsed(), trained))
        last = st.get("trainer", {}).get("last_step") or {}
        if last and (not state.step_stats or state.step_stats[-1].get("step") != last.get("step")):
            state.step_stats.append({"t_s": round(state.elapsed(), 2), **last})
        if state.max_steps and st.get("trainer", {}).get("step", 0) >= state.max_steps:
            state.reward_at_stop = state.recent_reward()
            state.stopped_at = state.elapsed()
        serving = sum(r["state"] == "RUNNING" for r in st["replicas"])
        state.min_serving = serving if state.min_serving is None else min(state.min_serving, serving)
        for r in st["replicas"]:
            cur = (r["state"], r["policy_version"])
            if last.get(r["id"]) != cur:
                last[r["id"]] = cur
                state.replica_timeline[r["id"]].append((state.elapsed(), *cur))
        await asyncio.sleep(0.5)


def _view(state: DemoState, duration: float):
    from rich.table import Table

    t = Table(title=f"serve_rft demo  {state.elapsed():5.0f}/{duration:.0f} s", expand=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    st = state.status
    exps = st.get("experiences", {})
    rr = state.recent_reward()
    t.add_row("requests ok / failed", f"{state.ok} / {state.failed}")
    t.add_row("requests/s (10 s)", f"{state.rate():.2f}")
    t.add_row("mean reward (last 30 s)", f"{rr:.3f}" if rr is not None else "-")
    t.add_row("experiences pending / ready / trained",
              f"{exps.get('pending', 0)} / {exps.get('ready', 0)} / {exps.get('trained', 0)}")
    t.add_row("trainer step / policy version", f"{st.get('trainer', {}).get('step', 0)} / {st.get('policy_version', 0)}")
    for r in st.get("replicas", []):
        t.add_row(f"replica {r['id']}", f"{r['state']:>12}  v{r['policy_version']}")
    versions = sorted(state.reward_by_version)[-6:]
    for v in versions:
        rs = state.reward_by_version[v]
        t.add_row(f"reward @ v{v}", f"{statistics.fmean(rs):.3f} (n={len(rs)})")
    return t


async def demo_async(url: str, duration: float, users: int, n: int = 4, max_tokens: int = 16,
                     live: bool = True, api_key: str | None = None, max_steps: int | None = None,
                     task: str = "vowels", seed: int = 0) -> dict:
    """Drive the service at ``url`` for ``duration`` seconds with ``users`` concurrent users, or
    until the trainer has taken ``max_steps`` steps.
    ``api_key``: an admin key (the demo chats and posts rewards) when the service has keys.
    ``task``: ``vowels`` or ``letter`` (module docstring); ``seed``: the users' random choices."""
    state = DemoState(max_steps=max_steps)
    pending: set = set()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key or "demo", max_retries=0, timeout=120)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as http:
        tasks = [asyncio.create_task(_user(i, client, http, state, duration, n, max_tokens, pending, task, seed))
                 for i in range(users)]
        watcher = asyncio.create_task(_watch(http, state, duration))
        if live:
            from rich.console import Console
            from rich.live import Live

            with Live(_view(state, duration), console=Console(stderr=True), refresh_per_second=2) as lv:
                while not all(t.done() for t in tasks):
                    lv.update(_view(state, duration))
                    await asyncio.sleep(0.5)
        await asyncio.gather(*tasks)
        if pending:
            await asyncio.gather(*list(pending))
        await asyncio.sleep(1.0)
        st = (await http.get("/v1/status")).json()
        state.status = st
        await watcher
    await client.close()
    return state.summary()


def run_demo(url: str, duration: float, users: int, live: bool = True, api_key: str | None = None,
             max_steps: int | None = None, task: str = "vowels", seed: int = 0) -> dict:
    """Synchronous entry point for the CLI."""
    return asyncio.run(demo_async(url, duration, users, live=live, api_key=api_key, max_steps=max_steps,
                                  task=task, seed=seed))
