"""Experience logging in batches (`serve_rft.buffer.log_batch`): concurrent completions in one LOG
script call, each caller answered only after Redis acknowledged its own completion, a refused
completion failing only its caller, a failed call failing every caller, none dropped."""

import asyncio
import contextvars
from asyncio import run

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from serve_rft.buffer.log_batch import LogBatcher, LogQueueFull
from serve_rft.buffer.records import StoreFull
from serve_rft.buffer.store import SOCKET_TIMEOUT_S, ExperienceStore
from tests.support.experiences import experience


def _count_batches(store: ExperienceStore) -> list[int]:
    """Record the size of every LOG script call the store makes."""
    sizes: list[int] = []
    write = store.completions.batcher._write

    async def counted(items):
        sizes.append(len(items))
        return await write(items)
    store.completions.batcher._write = counted
    return sizes


def test_concurrent_completions_share_script_calls_and_each_is_in_redis_when_its_call_returns(store_factory):
    async def go():
        s = store_factory()
        sizes = _count_batches(s)
        seen_on_return = []

        async def one(k):
            await s.log_experiences([experience(f"chatcmpl-b{k}", 0), experience(f"chatcmpl-b{k}", 1)])
            seen_on_return.append(await s.get_experience(f"chatcmpl-b{k}", 1) is not None)

        await asyncio.gather(*(one(k) for k in range(40)))
        assert seen_on_return == [True] * 40
        assert sum(sizes) == 40 and len(sizes) < 40  # batched: fewer calls than completions
        c = await s.counts()
        assert (c.logged, c.pending) == (80, 80)
        states = await s.choices("chatcmpl-b7")
        assert [x.state for x in states] == ["pending", "pending"]
        assert await s.post_reward("chatcmpl-b7", 1, 0.5) is True
        await s.close()
    run(go())


def test_a_completion_logged_twice_in_one_batch_is_logged_once(store_factory):
    async def go():
        s = store_factory()
        exps = [experience("chatcmpl-dup", 0)]
        await asyncio.gather(s.log_experiences(exps), s.log_experiences(exps), s.log_experiences(exps))
        await s.log_experiences(exps)  # a retry after the reply was lost
        c = await s.counts()
        assert (c.logged, c.pending) == (1, 1)
        await s.close()
    run(go())


def test_one_refused_completion_fails_only_its_caller_and_writes_nothing_of_it(store_factory):
    async def go():
        s = store_factory()
        sizes = _count_batches(s)
        s.completions.batcher.max_in_flight = 1  # one batch holds all four
        await s.redis.set(s._k("conv:clash"), "not a list")  # a key of another type: WRONGTYPE
        calls = [s.log_experiences([experience(f"chatcmpl-ok{k}", 0)]) for k in range(3)]
        calls.insert(1, s.log_experiences([experience("chatcmpl-bad", 0)], conversation_id="clash"))
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert sizes == [4]  # all four in one script call
        assert isinstance(results[1], ResponseError) and "WRONGTYPE" in str(results[1])
        assert [r for k, r in enumerate(results) if k != 1] == [None, None, None]
        assert await s.num_choices("chatcmpl-bad") is None
        assert await s.get_experience("chatcmpl-bad", 0) is None
        for k in range(3):
            assert await s.get_experience(f"chatcmpl-ok{k}", 0) is not None
        c = await s.counts()
        assert (c.logged, c.pending) == (3, 3)
        await s.close()
    run(go())


def test_each_choice_of_a_mixed_batch_is_stored_as_logged_past_a_refused_or_repeated_completion(store_factory):
    """Each completion's JSON travels as script arguments found by position: a refused completion
    (and one logged before) in the middle of a batch must not shift what the ones after it store."""
    async def go():
        s = store_factory()
        sizes = _count_batches(s)
        s.completions.batcher.max_in_flight = 1  # one batch holds all of them
        await s.log_experiences([experience("chatcmpl-seen", 0)])
        await s.redis.set(s._k("conv:clash"), "not a list")  # a key of another type: WRONGTYPE

        def completion(cid, n, offset):
            exps = [experience(cid, i) for i in range(n)]
            for i, e in enumerate(exps):  # each choice's response tells it apart
                e.response_token_ids = [offset + i, 100 + offset, 200 + i]
            return exps
        batch = [completion("chatcmpl-m0", 2, 10), completion("chatcmpl-bad", 3, 20),
                 completion("chatcmpl-seen", 1, 30), completion("chatcmpl-m1", 1, 40),
                 completion("chatcmpl-m2", 4, 50)]
        conversations = [None, "clash", None, None, None]  # the bad one joins the clashing key
        results = await asyncio.gather(*(s.log_experiences(exps, conversation_id=conv)
                                         for exps, conv in zip(batch, conversations)), return_exceptions=True)
        assert sizes[-1] == 5
        assert isinstance(results[1], ResponseError) and [r for k, r in enumerate(results) if k != 1] == [None] * 4
        for exps in batch:
            cid = exps[0].completion_id
            if cid == "chatcmpl-bad":
                assert await s.num_choices(cid) is None
                continue
            if cid == "chatcmpl-seen":  # logged before: the first logging stays
                assert (await s.get_experience(cid, 0)).response_token_ids == [5, 6, 7]
                continue
            assert await s.num_choices(cid) == len(exps)
            for e in exps:
                assert await s.get_experience(cid, e.choice_index) == e
        assert (await s.counts()).logged == 1 + 2 + 1 + 4
        await s.close()
    run(go())


def test_a_full_store_refuses_every_completion_of_a_batch_and_takes_them_after_it_drains(tmp_path):
    from serve_rft.buffer.redis_server import start_redis

    server = start_redis(tmp_path / "r", maxmemory_bytes=3 * 2**20)

    async def go():
        s = ExperienceStore(server.url, prefix="fullbatch")
        await s.log_experiences([experience("chatcmpl-first", 0)])
        await s.redis.config_set("maxmemory", 1)
        results = await asyncio.gather(*(s.log_experiences([experience(f"chatcmpl-f{k}", 0)]) for k in range(5)),
                                       return_exceptions=True)
        assert all(isinstance(r, StoreFull) for r in results), results
        for k in range(5):
            assert await s.num_choices(f"chatcmpl-f{k}") is None
        await s.redis.config_set("maxmemory", 3 * 2**20)
        await asyncio.gather(*(s.log_experiences([experience(f"chatcmpl-f{k}", 0)]) for k in range(5)))
        assert (await s.counts()).logged == 6
        await s.close()
    try:
        run(go())
    finally:
        server.stop()


def test_a_redis_that_is_gone_fails_every_caller_of_the_batch(tmp_path):
    from serve_rft.buffer.redis_server import free_port

    async def go():
        s = ExperienceStore(f"redis://127.0.0.1:{free_port()}", prefix="gone", reconnect_s=0.1)
        results = await asyncio.gather(*(s.log_experiences([experience(f"chatcmpl-g{k}", 0)]) for k in range(6)),
                                       return_exceptions=True)
        assert all(isinstance(r, RedisConnectionError) for r in results), results
        await s.close()
    run(go())


def test_the_batcher_bounds_batches_keeps_order_and_answers_each_caller_its_own_result():
    async def go():
        batches: list[list[bytes]] = []

        async def write(items):
            batches.append(items)
            await asyncio.sleep(0.001)
            return [ValueError(i.decode()) if i == b"refuse" else len(i) for i in items]

        b = LogBatcher(write, max_items=8, max_bytes=1000)
        items = [b"x" * (k % 7 + 1) for k in range(50)] + [b"refuse", b"y" * 5000, b"z"]
        results = await asyncio.gather(*(b.submit(i) for i in items), return_exceptions=True)
        assert results[:50] == [len(i) for i in items[:50]]
        assert isinstance(results[50], ValueError) and str(results[50]) == "refuse"
        assert results[51:] == [5000, 1]
        assert all(len(x) <= 8 for x in batches)
        assert all(sum(map(len, x)) <= 1000 or len(x) == 1 for x in batches)  # a larger item goes alone
        assert [i for x in batches for i in x] == items  # every item once, in submission order
    run(go())


def test_an_error_of_one_batch_fails_all_its_callers_and_the_next_batch_still_runs():
    async def go():
        calls = 0

        async def write(items):
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("connection lost")
            return list(items)

        b = LogBatcher(write, max_in_flight=1)
        first = await asyncio.gather(*(b.submit(b"a%d" % k) for k in range(5)), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in first)
        assert await asyncio.gather(*(b.submit(b"b%d" % k) for k in range(5))) == [b"b%d" % k for k in range(5)]
    run(go())


def test_a_caller_cancelled_before_its_batch_formed_is_not_written_and_none_waits_forever():
    async def go():
        written: list[bytes] = []
        gate = asyncio.Event()

        async def write(items):
            await gate.wait()
            written.extend(items)
            return [1] * len(items)

        b = LogBatcher(write, max_in_flight=1)
        first = asyncio.ensure_future(b.submit(b"first"))
        await asyncio.sleep(0.01)  # the first batch is in flight
        cancelled = asyncio.ensure_future(b.submit(b"cancelled"))
        kept = asyncio.ensure_future(b.submit(b"kept"))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(first, kept), 5) == [1, 1]
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert written == [b"first", b"kept"]
        assert await asyncio.wait_for(b.submit(b"later"), 5) == 1  # a new flusher starts
    run(go())


def test_a_lone_caller_that_gave_up_while_redis_stalled_is_never_written(tmp_path):
    """A completion answered "not logged" (its caller's wait ran out) must not land when Redis
    answers again: its batch's write is abandoned once no caller waits for it."""
    from serve_rft.buffer.redis_server import start_redis

    server = start_redis(tmp_path / "r")

    async def go():
        s = ExperienceStore(server.url, prefix="stall")
        await s.log_experiences([experience("chatcmpl-before", 0)])
        admin = aioredis.from_url(server.url)
        await admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # Redis takes no command for 1.5 s
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(s.log_experiences([experience("chatcmpl-gaveup", 0)]), 0.3)
        await asyncio.sleep(1.7)  # Redis answers again
        assert await s.num_choices("chatcmpl-gaveup") is None
        assert await s.get_experience("chatcmpl-gaveup", 0) is None
        assert (await s.counts()).logged == 1
        assert s.completions.batcher.held_bytes == 0 and s.completions.batcher.queued == 0
        await s.log_experiences([experience("chatcmpl-after", 0)])  # the store still logs
        assert await s.num_choices("chatcmpl-after") == 1
        await admin.aclose()
        await s.close()
    try:
        run(go())
    finally:
        server.stop()


def test_a_lone_caller_that_gave_up_while_redis_was_down_is_not_written_when_it_returns(tmp_path):
    """Redis down, a completion's caller gives up, Redis back within seconds: the completion is
    not there (redis-py's reconnect retries stop with the abandoned write)."""
    from serve_rft.buffer.redis_server import start_redis

    server = start_redis(tmp_path / "r", appendfsync="everysec")
    state = {"server": server}

    async def go():
        s = ExperienceStore(server.url, prefix="down", reconnect_s=20)
        await s.log_experiences([experience("chatcmpl-up", 0)])
        server.stop()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(s.log_experiences([experience("chatcmpl-away", 0)]), 0.5)
        state["server"] = start_redis(server.data_dir, port=server.port, appendfsync="everysec")
        await asyncio.sleep(2.5)  # longer than redis-py's backoff between reconnect tries (1 s)
        assert await s.num_choices("chatcmpl-up") == 1
        assert await s.num_choices("chatcmpl-away") is None
        await s.close()
    try:
        run(go())
    finally:
        state["server"].stop()


def test_a_batch_is_written_while_one_caller_waits_and_abandoned_when_none_does():
    async def go():
        gate = asyncio.Event()
        calls: list[str] = []

        async def write(items):
            calls.append("start")
            try:
                await gate.wait()
            except asyncio.CancelledError:
                calls.append("cancelled")
                raise
            calls.append("written")
            return [1] * len(items)

        b = LogBatcher(write, max_in_flight=1)
        one, two = asyncio.ensure_future(b.submit(b"one")), asyncio.ensure_future(b.submit(b"two"))
        await asyncio.sleep(0.01)
        one.cancel()  # the other caller still waits: the batch goes on
        await asyncio.sleep(0.01)
        assert calls == ["start"]
        gate.set()
        assert await asyncio.wait_for(two, 5) == 1 and calls == ["start", "written"]

        gate.clear()
        three, four = asyncio.ensure_future(b.submit(b"three")), asyncio.ensure_future(b.submit(b"four"))
        await asyncio.sleep(0.01)
        three.cancel()
        four.cancel()
        await asyncio.sleep(0.01)  # no caller waits: the write is cancelled, its bytes released
        assert calls == ["start", "written", "start", "cancelled"]
        assert b.held_bytes == 0
        gate.set()
        assert await asyncio.wait_for(b.submit(b"five"), 5) == 1
    run(go())


def test_cancelled_callers_leave_the_queue_at_once_and_held_bytes_are_capped():
    async def go():
        gate = asyncio.Event()

        async def write(items):
            await gate.wait()
            return [len(i) for i in items]

        b = LogBatcher(write, max_in_flight=1, max_held_bytes=100)
        first = asyncio.ensure_future(b.submit(b"f" * 10))
        await asyncio.sleep(0.01)  # in flight, stuck
        queued = [asyncio.ensure_future(b.submit(b"q" * 30)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert b.queued == 3 and b.held_bytes == 100
        with pytest.raises(LogQueueFull) as refused:  # at once, while Redis is stuck
            await asyncio.wait_for(b.submit(b"x"), 1)
        assert isinstance(refused.value, RedisError)
        for q in queued:
            q.cancel()
        await asyncio.sleep(0)
        assert b.queued == 0 and b.held_bytes == 10  # removed at once, not when a flusher pops them
        late = asyncio.ensure_future(b.submit(b"l" * 80))  # room again
        await asyncio.sleep(0.01)
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(first, late), 5) == [10, 80]
        assert b.held_bytes == 0 and b.queued == 0
    run(go())


def test_each_caller_gets_its_own_exception_chained_to_the_batch_error():
    async def go():
        async def write(items):
            raise RedisConnectionError("connection lost")

        b = LogBatcher(write, max_in_flight=1)  # one batch holds all four
        results = await asyncio.gather(*(b.submit(b"a%d" % k) for k in range(4)), return_exceptions=True)
        assert all(isinstance(r, RedisConnectionError) and str(r) == "connection lost" for r in results)
        assert len({id(r) for r in results}) == 4
        assert len({id(r.__cause__) for r in results}) == 1 and isinstance(results[0].__cause__, RedisConnectionError)
    run(go())


def test_a_wrong_result_count_fails_each_caller_with_a_redis_error():
    async def go():
        async def write(items):
            return [1] * (len(items) + 1)

        b = LogBatcher(write)
        results = await asyncio.gather(*(b.submit(b"a%d" % k) for k in range(3)), return_exceptions=True)
        assert all(isinstance(r, ResponseError) for r in results), results
        assert len({id(r) for r in results}) == 3
    run(go())


def test_an_unexpected_log_reply_is_a_redis_error(store_factory):
    async def go():
        s = store_factory()
        replies = iter([[1.5], "OK"])

        async def script(args):
            return next(replies)
        s.completions._log = script
        for _ in range(2):
            with pytest.raises(ResponseError):
                await s.log_experiences([experience("chatcmpl-odd", 0)])
        await s.close()
    run(go())


def test_the_write_runs_outside_the_callers_context():
    var = contextvars.ContextVar("request", default="none")

    async def go():
        seen = []

        async def write(items):
            seen.append(var.get())
            return [1] * len(items)

        b = LogBatcher(write)
        var.set("caller-1")
        assert await b.submit(b"a") == 1
        assert seen == ["none"]
    run(go())


def test_a_group_key_of_another_type_refuses_the_completion_before_any_write(store_factory):
    async def go():
        s = store_factory()
        await s.redis.set(s._k("grp", "g-clash"), "not a hash")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await s.log_experiences([experience("chatcmpl-clash", 0, group="g-clash")])
        assert await s.num_choices("chatcmpl-clash") is None
        assert await s.redis.exists(s._k("cmp", "chatcmpl-clash"), s._k("exp", "chatcmpl-clash", "0")) == 0
        assert (await s.counts()).logged == 0
        await s.close()
    run(go())


def test_the_store_client_has_a_socket_timeout_and_keeps_retrying(store_factory):
    s = store_factory()
    kw = s.redis.connection_pool.connection_kwargs
    assert kw["socket_timeout"] == SOCKET_TIMEOUT_S
    assert kw["retry"].get_retries() >= 1
    run(s.close())
