"""ToolRunner: tool calls in worker processes, time-limited, bounded, isolated, run once per call id."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from slime.utils.tool_calls import QWEN_FORMAT, AgentEnv, ToolCallFormat, ToolSpec
from slime.utils.tool_runner import ToolRunner

TIMEOUT_S = 1.5


def spec(name: str, **kw) -> ToolSpec:
    return ToolSpec(name, f"tests.tool_plugins.{name}", **kw)


@pytest.fixture(scope="module")
def runner():
    with ToolRunner(workers=2, timeout_s=TIMEOUT_S, max_output_chars=64) as r:
        yield r


def call(runner, call_id, name, arguments=None, **kw):
    return runner.submit(call_id, spec(name, **kw), arguments).result(timeout=60)


def test_text_in_text_out_with_plain_and_json_arguments(runner):
    assert call(runner, "a1", "echo", "37-5").output == "echo:37-5"
    res = call(runner, "a2", "upper", {"text": "ok"})
    assert res.ok and res.output == "OK" and res.error is None and res.seconds >= 0


def test_failures_are_results_that_name_the_cause_and_the_runner_goes_on(runner):
    raised = call(runner, "f1", "raises")
    assert not raised.ok and "raised ZeroDivisionError: division by zero" in raised.error
    assert call(runner, "f2", "returns_int").error == "returned int, not str"
    died = call(runner, "f3", "exits")
    assert not died.ok and died.error == "worker exited with code 3"
    assert call(runner, "f4", "echo", "after").output == "echo:after"  # a fresh worker took over


def test_output_is_bounded_and_prints_stay_out_of_it(runner):
    flood = call(runner, "o1", "floods")
    assert flood.ok and flood.truncated and flood.output == "x" * 64
    assert call(runner, "o2", "prints_then_answers").output == "answer"


def test_a_hanging_tool_is_cut_at_its_limit_while_other_calls_go_on(runner):
    hang = runner.submit("h1", spec("hangs"), None)
    quick = [runner.submit(f"h-echo{i}", spec("echo"), str(i)) for i in range(5)]
    for i, f in enumerate(quick):  # served by the other worker while the first one hangs
        assert f.result(timeout=60).output == f"echo:{i}"
    assert not hang.done()
    res = hang.result(timeout=60)
    assert not res.ok and res.error == f"timed out after {TIMEOUT_S:g}s"  # the runner's deadline cut it
    per_tool = runner.submit("h2", spec("hangs", timeout_s=0.2), None).result(timeout=60)
    assert per_tool.error == "timed out after 0.2s"
    assert call(runner, "h3", "echo", "x").ok


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        with ToolRunner(workers=1, timeout_s=10) as r:
            res = r.submit("n1", spec("connects"), str(port)).result(timeout=60)
            assert not res.ok and "no network" in res.error
            assert r.isolation in ("netns+audit", "audit")
    finally:
        server.close()


def test_workers_see_none_of_the_trainers_environment(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    with ToolRunner(workers=1) as r:
        names = r.submit("e1", spec("environment"), None).result(timeout=60).output.split(",")
    assert "WANDB_API_KEY" not in names and "HTTPS_PROXY" not in names and "PATH" in names


def test_a_call_id_runs_once_until_forgotten(tmp_path):
    marker = str(tmp_path / "runs.txt")
    with ToolRunner(workers=2) as r:
        first = r.submit("c1", spec("counts_runs"), marker)
        again = r.submit("c1", spec("counts_runs"), marker)
        assert again is first and r.lookup("c1") is first
        assert first.result(timeout=60).output == "done"
        assert r.submit("c1", spec("counts_runs"), marker).result(timeout=60).output == "done"
        assert open(marker).read() == "run\n"
        r.forget("c1")
        assert r.lookup("c1") is None
        r.submit("c1", spec("counts_runs"), marker).result(timeout=60)
        assert open(marker).read() == "run\nrun\n"
        assert r.lookup("never-submitted") is None


def test_results_are_awaitable_from_any_event_loop_and_kept_within_a_bound():
    async def one(r, i):
        return await asyncio.wait_for(asyncio.wrap_future(r.submit(f"k{i}", spec("echo"), str(i))), 60)

    with ToolRunner(workers=1, keep_results=3) as r:
        for i in range(5):  # a new event loop each time, as a rollout step run with asyncio.run
            assert asyncio.run(one(r, i)).output == f"echo:{i}"
        assert [r.lookup(f"k{i}") is None for i in range(5)] == [True, True, False, False, False]


def test_close_kills_the_workers():
    r = ToolRunner(workers=2)
    pids = {int(r.submit(f"p{i}", spec("pid"), None).result(timeout=60).output) for i in range(4)}
    r.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        r.submit("p9", spec("pid"), None)


def test_runner_refuses_bad_settings():
    with pytest.raises(ValueError, match="timeout_s > 0"):
        ToolRunner(timeout_s=0)


# ---- the call format -----------------------------------------------------------------------------------------
PLAIN = AgentEnv(tools=(spec("echo"),), call_format=ToolCallFormat("[", "]"), bad_call_output="?{error}")


def test_plain_calls_are_read_from_the_end_of_a_turn():
    call_ = PLAIN.parse_call("42,37,[37-5]")
    assert (call_.name, call_.arguments, call_.text, call_.error) == ("echo", "37-5", "[37-5]", None)
    assert PLAIN.parse_call("42,37,32") is None  # an answer
    assert PLAIN.parse_call("42]").error == "']' without '['"
    assert PLAIN.call_format.format_call("echo", "37-5") == "[37-5]"


def test_json_calls_name_their_tool_and_bad_ones_say_why():
    env = AgentEnv(tools=(spec("echo"), spec("upper")), call_format=QWEN_FORMAT)
    text = 'Let me check. ' + QWEN_FORMAT.format_call("upper", {"text": "hi"})
    c = env.parse_call(text)
    assert (c.name, c.arguments, c.error) == ("upper", {"text": "hi"}, None) and text.endswith(c.text)
    assert "not JSON" in env.parse_call("<tool_call>{oops</tool_call>").error
    assert "no tool named 'search'" in env.parse_call('<tool_call>{"name": "search"}</tool_call>').error
    assert env.bad_call_text("x") == "error: x"
    with pytest.raises(ValueError, match="exactly one"):
        AgentEnv(tools=(spec("echo"), spec("upper")), call_format=ToolCallFormat("[", "]"))


OWNER = """
import sys, time
from slime.utils.tool_calls import ToolSpec
from slime.utils.tool_runner import ToolRunner
r = ToolRunner(workers=2, timeout_s=600)
pids = [r.submit(f"p{i}", ToolSpec("pid", "tests.tool_plugins.pid"), None).result(timeout=60).output for i in range(2)]
r.submit("h", ToolSpec("hangs", "tests.tool_plugins.hangs"), None)
print(r.scratch_dir, *pids, flush=True)
time.sleep(600)
"""


def test_a_killed_owner_leaves_no_worker_and_its_scratch_is_cleaned_later():
    import signal
    import subprocess
    import sys
    import time

    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    scratch, *pids = owner.stdout.readline().split()
    assert os.path.isdir(scratch) and pids
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=30)
    def alive(pid):  # a zombie waiting for init to reap it is dead
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)  # the workers died with their owner
    with ToolRunner(workers=1):
        assert not os.path.exists(scratch)
