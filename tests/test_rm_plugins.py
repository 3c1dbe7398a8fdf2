"""Custom rewards and the remote reward server."""

import asyncio
import contextlib
import importlib
import socket
import sys
import textwrap
import threading

import pytest
from aiohttp import web

from slime.rollout.rm_hub import async_rm, batched_async_rm, reward_group
from slime.rollout.rm_hub.threads import run_in_daemon_thread
from slime.utils.types import Status

from test_rm_hub import sample


# ---------------------------------------------------------------- custom rms ----
PLUGIN = textwrap.dedent(
    """
    import asyncio, threading

    # a "slow" reward blocks until the test sets RELEASE, which it does only after checking the group finished:
    # the group finishing at all shows the slow reward did not hold it (no clock involved). The wait's own bound
    # is a safety net that makes the reward succeed, which the tests would then flag.
    BLOCKED, RELEASE = threading.Event(), threading.Event()
    HOLD_S = 120

    def hold():
        BLOCKED.set()
        RELEASE.wait(HOLD_S)

    async def length_rm(args, sample):
        return float(len(sample.response))

    async def flaky_rm(args, sample):
        if sample.response == "boom":
            raise RuntimeError("checker exploded")
        if sample.response == "slow":
            await asyncio.to_thread(hold)
        if sample.response == "text":
            return "one"
        return 1.0 if sample.response == sample.label else 0.0

    def blocking_rm(args, sample):
        if sample.response == "slow":
            hold()
        return 2.0

    async def group_rm(args, samples):
        best = max(len(s.response) for s in samples)
        return [1.0 if len(s.response) == best else 0.0 for s in samples]

    async def short_group_rm(args, samples):
        return [1.0]

    async def async_blocking_rm(args, sample):
        if sample.response == "slow":
            hold()  # blocks inside async def: must not freeze the caller's event loop
        return 1.0

    async def cancelling_rm(args, sample):
        if sample.response == "cancel":
            raise asyncio.CancelledError("checker gave up")
        return 1.0

    async def dict_rm(args, sample):
        return {"score": float(len(sample.response)), "acc": True, "pred": sample.response}
    """
)


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    (tmp_path / "rm_plugins_for_test.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("rm_plugins_for_test", None)  # fresh BLOCKED / RELEASE events for each test
    yield "rm_plugins_for_test"
    module = sys.modules.pop("rm_plugins_for_test", None)
    if module is not None:
        module.RELEASE.set()  # let a held reward's thread end


@contextlib.contextmanager
def held(plugins):
    """The plugin module; its slow rewards stay blocked until the block exits."""
    module = importlib.import_module(plugins)
    try:
        yield module
    finally:
        module.RELEASE.set()


def test_custom_rm_wins_over_rm_type(plugins, parse_with):
    args = parse_with(rm_type="dapo", custom_rm_path=f"{plugins}.length_rm")
    assert asyncio.run(async_rm(args, sample("abcd", "x"))) == 4.0


def test_reward_group_isolates_raising_and_slow_rewards(plugins, parse_with):
    args = parse_with(custom_rm_path=f"{plugins}.flaky_rm", reward_timeout=0.5)
    samples = [sample(r, "7", index=i) for i, r in enumerate(["7", "boom", "slow", "8", "text"])]
    with held(plugins) as plugin:
        asyncio.run(reward_group(args, samples))
        # the group finished while the slow reward still blocked (RELEASE is set only below): it did not hold it
        assert plugin.BLOCKED.is_set()
    assert [s.reward for s in samples] == [1.0, None, None, 0.0, None]
    assert [s.status for s in samples] == [Status.COMPLETED, Status.FAILED, Status.FAILED, Status.COMPLETED, Status.FAILED]
    assert samples[1].metadata["failure"] == "reward: RuntimeError: checker exploded"
    assert samples[2].metadata["failure"].startswith("reward: TimeoutError:") and "--reward-timeout" in samples[2].metadata["failure"]
    assert samples[4].metadata["failure"].startswith("reward: TypeError:")
    assert "failure" not in samples[0].metadata


def test_sync_blocking_custom_rm_is_bounded(plugins, parse_with):
    args = parse_with(custom_rm_path=f"{plugins}.blocking_rm", reward_timeout=0.3)
    samples = [sample("fast", index=0), sample("slow", index=1)]
    with held(plugins) as plugin:
        asyncio.run(reward_group(args, samples))
        assert plugin.BLOCKED.is_set()  # returned while the blocking reward still blocks its thread
    assert samples[0].reward == 2.0 and samples[1].status == Status.FAILED
    assert samples[1].metadata["failure"].startswith("reward: TimeoutError:")  # --reward-timeout released it


def test_batched_async_rm_raises_where_reward_group_does_not(plugins, parse_with):
    args = parse_with(custom_rm_path=f"{plugins}.flaky_rm")
    with pytest.raises(RuntimeError, match="checker exploded"):
        asyncio.run(batched_async_rm(args, [sample("7", "7"), sample("boom", "7")]))
    assert asyncio.run(batched_async_rm(args, [sample("7", "7"), sample("6", "7")])) == [1.0, 0.0]


def test_group_rm(plugins, parse_with):
    args = parse_with(custom_rm_path=f"{plugins}.group_rm", group_rm=True)
    samples = [sample("aa"), sample("aaaa"), sample("a")]
    asyncio.run(reward_group(args, samples))
    assert [s.reward for s in samples] == [0.0, 1.0, 0.0]
    assert asyncio.run(batched_async_rm(args, samples)) == [0.0, 1.0, 0.0]


def test_group_rm_wrong_length_fails_whole_group(plugins, parse_with):
    args = parse_with(custom_rm_path=f"{plugins}.short_group_rm", group_rm=True)
    samples = [sample("a"), sample("b")]
    asyncio.run(reward_group(args, samples))
    assert all(s.status == Status.FAILED and s.reward is None for s in samples)
    assert "must return 2 rewards, got 1 values" in samples[0].metadata["failure"]


def test_already_failed_samples_are_skipped(plugins, parse_with):
    args = parse_with(custom_rm_path=f"{plugins}.length_rm")
    s_failed = sample("abc")
    s_failed.status = Status.FAILED
    s_failed.metadata["failure"] = "generation: engine died"
    s_ok = sample("abcdef")
    asyncio.run(reward_group(args, [s_failed, s_ok]))
    assert s_failed.reward is None and s_failed.metadata["failure"] == "generation: engine died"
    assert s_ok.reward == 6.0


def test_daemon_thread_timeout_releases_caller():
    started, release = threading.Event(), threading.Event()

    def blocked():
        started.set()
        release.wait(120)  # set only after the caller was released; the bound is a safety net

    async def go():
        with pytest.raises(TimeoutError):
            await run_in_daemon_thread(blocked, timeout=0.2)
        assert started.is_set() and not release.is_set()  # released while the call still blocks
        release.set()
        assert await run_in_daemon_thread(pow, 2, 10, timeout=5) == 1024
        with pytest.raises(ZeroDivisionError):
            await run_in_daemon_thread(lambda: 1 / 0)

    asyncio.run(go())


# ---------------------------------------------------------------- remote rm ----
@pytest.fixture
def rm_server():
    """A small reward-model server on 127.0.0.1 in its own thread and event loop."""
    received, release = [], threading.Event()

    async def reward(request):
        body = await request.json()
        received.append(body)
        if body["response"] == "crash":
            return web.Response(status=500, text="internal error")
        if body["response"] == "slow":  # answers only once the test sets `release` (or the server stops)
            while not release.is_set():
                await asyncio.sleep(0.02)
        if body["response"] == "garbage":
            return web.json_response({"verdict": "good"})
        if body["response"] == "bare":
            return web.json_response(0.25)
        return web.json_response({"reward": 1.0 if body["response"] == body["label"] else -0.5})

    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = web.Application()
    app.router.add_post("/reward", reward)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/reward", received, release
    release.set()
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def test_remote_rm(rm_server, parse_with):
    url, received, _ = rm_server
    args = parse_with(rm_type="remote_rm", rm_url=url, reward_timeout=1.0)
    s = sample("42", "42")
    s.prompt = "What is 6*7?"
    assert asyncio.run(async_rm(args, s)) == 1.0
    assert received[-1] == {"prompt": "What is 6*7?", "response": "42", "label": "42"}
    assert asyncio.run(async_rm(args, sample("41", "42"))) == -0.5
    assert asyncio.run(async_rm(args, sample("bare", "42"))) == 0.25


def test_boxed_remote_rm_sends_the_boxed_answer(rm_server, parse_with):
    url, received, _ = rm_server
    args = parse_with(rm_type="boxed_remote_rm", rm_url=url)
    assert asyncio.run(async_rm(args, sample(r"so it is \boxed{42}.", "42"))) == 1.0
    assert received[-1]["response"] == "42"


def test_remote_rm_errors_become_failures(rm_server, parse_with):
    url, received, release = rm_server
    args = parse_with(rm_type="remote_rm", rm_url=url, reward_timeout=0.5)
    samples = [sample(r, "ok", index=i) for i, r in enumerate(["ok", "crash", "slow", "garbage"])]
    asyncio.run(reward_group(args, samples))
    # the group finished while the server still held the slow request (it answers only once released)
    assert "slow" in [b["response"] for b in received]
    release.set()
    assert samples[0].reward == 1.0
    fails = [s.metadata.get("failure", "") for s in samples[1:]]
    assert "HTTP 500" in fails[0] and url in fails[0]
    assert fails[1].startswith("reward: TimeoutError")
    assert "without 'reward'/'score'" in fails[2]


def test_remote_rm_needs_url(base_args):
    with pytest.raises(ValueError, match="--rm-url"):
        asyncio.run(async_rm(base_args.replace(rm_type="remote_rm"), sample("x", "y")))


def test_reward_blocking_inside_async_def_cannot_freeze_the_loop(plugins, parse_with):
    args = parse_with(custom_rm_path=f"{plugins}.async_blocking_rm", reward_timeout=0.3)
    samples = [sample("fast", index=0), sample("slow", index=1)]

    async def run(plugin):
        ticked_while_blocked = asyncio.Event()

        async def ticker():
            while True:
                await asyncio.sleep(0.02)
                if plugin.BLOCKED.is_set() and not plugin.RELEASE.is_set():
                    ticked_while_blocked.set()

        t = asyncio.create_task(ticker())
        await reward_group(args, samples)  # returns only if --reward-timeout fired on this (unfrozen) loop
        # a safety net only: the ticker ticks within a few loop turns unless the reward froze this loop
        await asyncio.wait_for(ticked_while_blocked.wait(), 60)
        t.cancel()

    with held(plugins) as plugin:  # the loop kept running (and the group finished) while the reward blocked
        asyncio.run(run(plugin))
    assert samples[0].reward == 1.0
    assert samples[1].status == Status.FAILED and "TimeoutError" in samples[1].metadata["failure"]


def test_reward_raising_cancelled_error_fails_its_sample_and_settles(plugins, parse_with):
    args = parse_with(custom_rm_path=f"{plugins}.cancelling_rm")
    samples = [sample("ok", index=0), sample("cancel", index=1)]
    asyncio.run(asyncio.wait_for(reward_group(args, samples), 10))
    assert samples[0].reward == 1.0
    assert samples[1].status == Status.FAILED and "CancelledError" in samples[1].metadata["failure"]


def test_dict_rewards_follow_reward_key(plugins, parse_with):
    s = sample("abc")
    asyncio.run(reward_group(parse_with(custom_rm_path=f"{plugins}.dict_rm", reward_key="score"), [s]))
    assert s.reward == {"score": 3.0, "acc": True, "pred": "abc"} and s.scalar_reward("score") == 3.0
    s = sample("abc")
    asyncio.run(reward_group(parse_with(custom_rm_path=f"{plugins}.dict_rm"), [s]))
    assert s.status == Status.FAILED and "pass --reward-key" in s.metadata["failure"]
    s = sample("abc")
    asyncio.run(reward_group(parse_with(custom_rm_path=f"{plugins}.dict_rm", reward_key="reward"), [s]))
    assert s.status == Status.FAILED and "no field 'reward' (--reward-key)" in s.metadata["failure"]
    s = sample("abc")
    asyncio.run(reward_group(parse_with(custom_rm_path=f"{plugins}.dict_rm", reward_key="pred"), [s]))
    assert s.status == Status.FAILED and "field 'pred'" in s.metadata["failure"]
