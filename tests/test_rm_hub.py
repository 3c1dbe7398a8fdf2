import asyncio
import contextlib
import importlib
import math
import random
from fractions import Fraction
import socket
import sys
import textwrap
import threading
import types

import pytest
from aiohttp import web

from slime.arguments import parse_args
from slime.rollout.rm_hub import async_rm, batched_async_rm, reward_group
from slime.rollout.rm_hub.dapo import dapo_score, normalize_final_answer
from slime.rollout.rm_hub.math_grader import answers_match
from slime.rollout.rm_hub.math_utils import extract_boxed_answer, last_boxed_only_string, strip_eos_text
from slime.rollout.rm_hub.threads import run_in_daemon_thread
from slime.utils.types import Sample, Status


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm_args")
    (d / "ckpt").mkdir()
    (d / "prompts.jsonl").write_text('{"prompt": "1"}\n')
    return d


@pytest.fixture
def make_args(run_dir):
    """Real parsed (immutable) args: `make_args(rm_type="math", reward_timeout=0.5, group_rm=True, ...)`."""

    def build(**kw):
        argv = ["--hf-checkpoint", str(run_dir / "ckpt"), "--prompt-data", str(run_dir / "prompts.jsonl"),
                "--rollout-batch-size", "1", "--num-rollout", "1"]
        for key, value in kw.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not None and value is not False:
                argv += [flag, str(value)]
        return parse_args(argv)

    return build


def sample(response, label=None, index=0, **kw):
    return Sample(index=index, group_index=0, prompt="Q", response=response, label=label, status=Status.COMPLETED, **kw)


@pytest.fixture
def rm(make_args):
    def score(rm_type, response, label):
        return asyncio.run(async_rm(make_args(rm_type=rm_type), sample(response, label)))

    return score


# ---------------------------------------------------------------- extraction ----
def test_boxed_extraction_nested_and_unbalanced():
    text = r"first \boxed{1} then \boxed{\frac{1}{\sqrt{2}}} done"
    assert last_boxed_only_string(text) == r"\boxed{\frac{1}{\sqrt{2}}}"
    assert extract_boxed_answer(text) == r"\frac{1}{\sqrt{2}}"
    assert extract_boxed_answer(r"so \boxed{\frac{1}{2") is None  # cut off mid-answer
    assert extract_boxed_answer(r"answer \fbox{7}") == "7"
    assert extract_boxed_answer("no box") is None


@pytest.mark.parametrize(
    "pred, gold, same",
    [(r"\frac{1}{2}", "0.5", True), (r"\dfrac12", "1/2", True), ("1,000", "1000", True), (r"x = 5", "5", True),
     (r"\text{(B)}", "(B)", True), ("90^\\circ", "90", True), ("0.33", "1/3", False), ("2", "3", False)],
)
def test_answers_match(pred, gold, same):
    assert answers_match(pred, gold) is same


def test_strip_eos_text():
    assert strip_eos_text("Answer: 42<|im_end|>") == "Answer: 42"
    assert strip_eos_text("x<|im_end|>\n<|endoftext|> ") == "x"
    assert strip_eos_text("a <|im_end|> b") == "a <|im_end|> b"  # only at the end
    assert strip_eos_text("keep trailing space ") == "keep trailing space "


def test_equal_values_in_other_forms_match_and_different_values_do_not():
    """Property (seeded): an answer rewritten in another exact form matches; a different value never does."""
    rng = random.Random(9)
    for _ in range(300):
        a, b, k = rng.randint(1, 60), rng.randint(2, 60), rng.randint(2, 9)
        if math.gcd(a, b) != 1:
            continue
        frac = rf"\frac{{{a}}}{{{b}}}"
        for same in (f"{a}/{b}", rf"\dfrac{{{k * a}}}{{{k * b}}}", rf"{{{frac}}}", rf"\left({frac}\right)"):
            assert answers_match(same, frac), (same, frac)
        for other in (rf"\frac{{{b}}}{{{a}}}", rf"\frac{{{a + 1}}}{{{b}}}", rf"-\frac{{{a}}}{{{b}}}"):
            if a != b:
                assert not answers_match(other, frac), (other, frac)
        decimal = f"{a / b:.6f}"  # exact only when b | 10^6
        assert answers_match(decimal, frac) is (Fraction(decimal) == Fraction(a, b)), (decimal, frac)
        m = rng.choice([2, 3, 5, 6, 7, 10, 11])
        assert answers_match(rf"\sqrt{{{k * k * m}}}", rf"{k}\sqrt{{{m}}}")
        assert not answers_match(rf"\sqrt{{{k * k * m + 1}}}", rf"{k}\sqrt{{{m}}}")
        assert not answers_match(f"{k * math.sqrt(m):.8f}", rf"{k}\sqrt{{{m}}}")  # an approximation is wrong
        c, d = rng.randint(1, 20), rng.randint(21, 40)
        assert answers_match(f"{d}+{c}x+x^2", f"x^2+{c}x+{d}")
        assert not answers_match(f"x^2+{d}x+{c}", f"x^2+{c}x+{d}")
        n = rng.randint(0, 10**6)
        assert answers_match(f"{n:,}", str(n)) and not answers_match(str(n + rng.randint(1, 9)), str(n))


def test_expression_values_exact_inexact_and_undecided():
    from slime.rollout.rm_hub.math_expr import read
    from slime.rollout.rm_hub.math_value import evaluate, same_value

    assert evaluate(read(r"\frac{3}{4}+0.25")) == 1 and isinstance(evaluate(read(r"\sqrt{16}")), Fraction)
    assert isinstance(evaluate(read(r"\sqrt{2}")), complex)
    assert same_value(read("0.5"), read(r"\frac{1}{2}")) is True  # exact decimal
    assert same_value(read("1.4142135623730951"), read(r"\sqrt{2}")) is False  # decimal approximation
    assert same_value(read(r"1.5\pi"), read(r"\frac{3\pi}{2}")) is True  # both inexact, equal
    assert same_value(read("x+y"), read("y+x")) is True and same_value(read("x-y"), read("y-x")) is False
    assert same_value(read("1/x"), read("1/x")) is True  # points where x is 0 are skipped, not fatal
    assert same_value(read("2^{100000}"), read("3")) is None  # too large to evaluate: undecided
    assert read(r"\mathbb{R}") is None and read("x > 3") is None and read("(1,2)") is None
    # plain arithmetic (every reader agrees on its value) vs notation others may read differently
    assert read(r"2\sqrt{3}+\pi x").plain and read(r"\frac{a}{b}").plain
    assert not any(read(t).plain for t in ("x^23", r"\sin x", "e^2", "i+1", "5!", "|x|", r"\binom{5}{2}"))


@pytest.mark.parametrize(
    "pred",
    ["2^{2^{2^{2^{2^{2}}}}}", "9!!!!", "(" * 5000 + "1" + ")" * 5000, "{" * 400 + "1" + "}" * 400, "10^{10^{10}}",
     "x^{10^{9}}", r"\binom{1000000000}{5}", "1/0", "0^{-1}", "1000000!", "e^{e^{e^{e^{10}}}}", r"\sin(10^{300})",
     "|" * 100, "9" * 5000, r"\left(" * 2000 + "1" + r"\right)" * 2000, r"\frac{" * 200 + "1" + "}{2}" * 200],
)
def test_pathological_answers_are_bounded(pred):
    """Huge powers, factorials, nesting and lengths are refused (undecided = not a match), never computed."""
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("match", answers_match(pred, "3")), daemon=True)
    worker.start()
    worker.join(timeout=20)  # a hang guard, not a speed target
    assert not worker.is_alive(), f"answers_match hung on {pred[:40]!r}"
    assert result["match"] is False


@pytest.mark.parametrize(
    "rm_type, response, label, want",
    [
        # issue 9, bug 1: dapo with the EOS text the rollout keeps, and an integer-valued label
        ("dapo", "Answer: 42<|im_end|>", "42", 1.0),
        ("dapo", "Answer: 42<|endoftext|>", "42", 1.0),
        ("dapo", "Answer: 42", "42.0", 1.0),
        ("dapo", "Answer: 42", 42.0, 1.0),
        ("dapo", "Answer: 43<|im_end|>", "42.0", -1.0),
        # bug 4: deepscaler equivalences upstream's grader accepts
        ("deepscaler", r"<think>.</think> \boxed{1+x^2}", "x^2+1", 1.0),
        ("deepscaler", r"<think>.</think> \boxed{\sqrt{27}}", r"3\sqrt{3}", 1.0),
        ("deepscaler", r"<think>.</think> \boxed{\pi \cdot 2}", r"2\pi", 1.0),
        ("deepscaler", r"<think>.</think> \boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1.0),
        ("deepscaler", r"<think>.</think> \boxed{7\frac{3}{4}}", r"\frac{31}{4}", 1.0),
        ("deepscaler", r"<think>.</think> \boxed{45 degrees}", "45", 1.0),
        ("deepscaler", r"<think>.</think> \boxed{25 \text{ cm}}", "25", 1.0),
        ("deepscaler", r"<think>.</think> \boxed{\text{(B)}}", "B", 1.0),
        ("deepscaler", r"<think>.</think> \boxed{\$25}", "25", 1.0),
        ("deepscaler", r"<think>.</think> \boxed{6.283185307}", r"2\pi", 0.0),
        # bug 5: math rejects decimal approximations of exact labels, reads `\$` labels
        ("math", r"\boxed{6.283185307}", r"2\pi", 0.0),
        ("math", r"\boxed{2.2360679}", r"\sqrt{5}", 0.0),
        ("math", "The answer is 2.2360679.", r"\sqrt{5}", 0.0),
        ("math", r"\boxed{0.25}", r"\frac{1}{4}", 1.0),
        ("math", r"\boxed{25}", r"\$25", 1.0),
        ("math", r"\boxed{24}", r"\$25", 0.0),
    ],
)
def test_issue9_regressions(rm_type, response, label, want, rm):
    assert rm(rm_type, response, label) == want


# ----------------------------------------------------------------- rule rms ----
@pytest.mark.parametrize(
    "rm_type, response, label, want",
    [
        ("deepscaler", r"<think>half of 1</think> The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
        ("deepscaler", r"<think>hm</think> \boxed{\frac{1}{3}}", "0.5", 0.0),
        ("deepscaler", r"no reasoning block \boxed{\frac{1}{2}}", "0.5", 0.0),  # format is part of the reward
        ("deepscaler", r"<think>a</think> \boxed{12}", ["11", "12"], 1.0),  # any of several golds
        ("deepscaler", r"<think>a</think> \boxed{12}", r"\boxed{12}", 1.0),  # boxed gold
        ("dapo", "Let me compute.\nAnswer: 34", "34", 1.0),
        ("dapo", "Let me compute.\nanswer:  $34$", "34", 1.0),
        ("dapo", "Let me compute.\nAnswer: 35", "34", -1.0),
        ("dapo", r"The result is \boxed{34}", "34", -1.0),  # no Answer: line
        ("dapo", "Answer: 34\n" + "x" * 400, "34", -1.0),  # only the last 300 chars count
        ("math", r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        ("math", r"We get $x = \frac{2}{4}$, i.e. \boxed{\frac{2}{4}}", r"\frac{1}{2}", 1.0),
        ("math", r"\boxed{1+x^2}", "x^2+1", 1.0),
        ("math", r"\boxed{3}", "4", 0.0),
        ("math", "I do not know", "4", 0.0),
        ("boxed_math", r"first \boxed{5} then \boxed{\frac{1}{2}}", "0.5", 1.0),
        ("boxed_math", r"first \boxed{\frac{1}{2}} then \boxed{5}", "0.5", 0.0),  # the LAST box counts
        ("boxed_deepscaler", r"\boxed{0.75}", r"\frac{3}{4}", 1.0),
        ("boxed_dapo", r"so \boxed{34}", "34", 1.0),
        ("boxed_dapo", "no box", "34", -1.0),
    ],
)
def test_rule_rewards(rm_type, response, label, want, rm):
    assert rm(rm_type, response, label) == want


def test_dapo_details_and_normalisation():
    assert normalize_final_answer(r"x = \text{5 dollars}") == "5"
    assert normalize_final_answer(r"$\frac12$") == r"\frac{1}{2}"
    assert dapo_score("Answer: 1,234", "1234") == {"score": 1.0, "acc": True, "pred": "1234"}
    assert dapo_score("nothing", "3")["pred"] == "[INVALID]"


def test_metadata_rm_type_overrides_flag(make_args):
    s = sample("Answer: 3", "3", metadata={"rm_type": "dapo"})
    assert asyncio.run(async_rm(make_args(rm_type="deepscaler"), s)) == 1.0


def test_unknown_or_missing_rm_type_named(rm, base_args):
    with pytest.raises(ValueError, match=r"--rm-type 'nope'"):
        rm("nope", "x", "y")
    with pytest.raises(ValueError, match=r"--rm-type 'boxed_nope'"):
        rm("boxed_nope", r"\boxed{1}", "1")
    with pytest.raises(ValueError, match="--rm-type"):  # parse_args refuses this; the hub says so too
        asyncio.run(async_rm(base_args.replace(rm_type=None), sample("x", "y")))


def test_math_missing_label_fails_the_sample(make_args):
    s = sample(r"\boxed{1}", "")
    asyncio.run(reward_group(make_args(rm_type="math"), [s]))
    assert s.status == Status.FAILED and s.reward is None
    assert s.metadata["failure"].startswith("reward: ValueError:") and "--label-key" in s.metadata["failure"]


# ------------------------------------------------------------ subtract_chain ----
def test_subtract_chain_branch_calls_task_reward(monkeypatch, rm):
    calls = []
    fake = types.ModuleType("slime.tasks.subtract_chain")

    def compute_reward(response, label):
        calls.append((response, label))
        return 1.0 if response == label else 0.0

    fake.compute_reward = compute_reward
    monkeypatch.setitem(sys.modules, "slime.tasks.subtract_chain", fake)
    assert rm("subtract_chain", "41,38,35,32", "41,38,35,32") == 1.0
    assert rm("subtract_chain", "41,38,35,33", "41,38,35,32") == 0.0
    assert calls == [("41,38,35,32", "41,38,35,32"), ("41,38,35,33", "41,38,35,32")]


def test_subtract_chain_real_task(rm):
    import random

    task = pytest.importorskip("slime.tasks.subtract_chain")
    rng = random.Random(0)
    for _ in range(5):
        prompt, label = task.make_problem(rng)
        wrong = label[:-1] + str((int(label[-1]) + 1) % 10)
        assert rm("subtract_chain", label, label) == 1.0
        assert rm("subtract_chain", wrong, label) == 0.0


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


def test_custom_rm_wins_over_rm_type(plugins, make_args):
    args = make_args(rm_type="dapo", custom_rm_path=f"{plugins}.length_rm")
    assert asyncio.run(async_rm(args, sample("abcd", "x"))) == 4.0


def test_reward_group_isolates_raising_and_slow_rewards(plugins, make_args):
    args = make_args(custom_rm_path=f"{plugins}.flaky_rm", reward_timeout=0.5)
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


def test_sync_blocking_custom_rm_is_bounded(plugins, make_args):
    args = make_args(custom_rm_path=f"{plugins}.blocking_rm", reward_timeout=0.3)
    samples = [sample("fast", index=0), sample("slow", index=1)]
    with held(plugins) as plugin:
        asyncio.run(reward_group(args, samples))
        assert plugin.BLOCKED.is_set()  # returned while the blocking reward still blocks its thread
    assert samples[0].reward == 2.0 and samples[1].status == Status.FAILED
    assert samples[1].metadata["failure"].startswith("reward: TimeoutError:")  # --reward-timeout released it


def test_batched_async_rm_raises_where_reward_group_does_not(plugins, make_args):
    args = make_args(custom_rm_path=f"{plugins}.flaky_rm")
    with pytest.raises(RuntimeError, match="checker exploded"):
        asyncio.run(batched_async_rm(args, [sample("7", "7"), sample("boom", "7")]))
    assert asyncio.run(batched_async_rm(args, [sample("7", "7"), sample("6", "7")])) == [1.0, 0.0]


def test_group_rm(plugins, make_args):
    args = make_args(custom_rm_path=f"{plugins}.group_rm", group_rm=True)
    samples = [sample("aa"), sample("aaaa"), sample("a")]
    asyncio.run(reward_group(args, samples))
    assert [s.reward for s in samples] == [0.0, 1.0, 0.0]
    assert asyncio.run(batched_async_rm(args, samples)) == [0.0, 1.0, 0.0]


def test_group_rm_wrong_length_fails_whole_group(plugins, make_args):
    args = make_args(custom_rm_path=f"{plugins}.short_group_rm", group_rm=True)
    samples = [sample("a"), sample("b")]
    asyncio.run(reward_group(args, samples))
    assert all(s.status == Status.FAILED and s.reward is None for s in samples)
    assert "must return 2 rewards, got 1 values" in samples[0].metadata["failure"]


def test_already_failed_samples_are_skipped(plugins, make_args):
    args = make_args(custom_rm_path=f"{plugins}.length_rm")
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


def test_remote_rm(rm_server, make_args):
    url, received, _ = rm_server
    args = make_args(rm_type="remote_rm", rm_url=url, reward_timeout=1.0)
    s = sample("42", "42")
    s.prompt = "What is 6*7?"
    assert asyncio.run(async_rm(args, s)) == 1.0
    assert received[-1] == {"prompt": "What is 6*7?", "response": "42", "label": "42"}
    assert asyncio.run(async_rm(args, sample("41", "42"))) == -0.5
    assert asyncio.run(async_rm(args, sample("bare", "42"))) == 0.25


def test_boxed_remote_rm_sends_the_boxed_answer(rm_server, make_args):
    url, received, _ = rm_server
    args = make_args(rm_type="boxed_remote_rm", rm_url=url)
    assert asyncio.run(async_rm(args, sample(r"so it is \boxed{42}.", "42"))) == 1.0
    assert received[-1]["response"] == "42"


def test_remote_rm_errors_become_failures(rm_server, make_args):
    url, received, release = rm_server
    args = make_args(rm_type="remote_rm", rm_url=url, reward_timeout=0.5)
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


def test_reward_blocking_inside_async_def_cannot_freeze_the_loop(plugins, make_args):
    args = make_args(custom_rm_path=f"{plugins}.async_blocking_rm", reward_timeout=0.3)
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


def test_reward_raising_cancelled_error_fails_its_sample_and_settles(plugins, make_args):
    args = make_args(custom_rm_path=f"{plugins}.cancelling_rm")
    samples = [sample("ok", index=0), sample("cancel", index=1)]
    asyncio.run(asyncio.wait_for(reward_group(args, samples), 10))
    assert samples[0].reward == 1.0
    assert samples[1].status == Status.FAILED and "CancelledError" in samples[1].metadata["failure"]


def test_dict_rewards_follow_reward_key(plugins, make_args):
    s = sample("abc")
    asyncio.run(reward_group(make_args(custom_rm_path=f"{plugins}.dict_rm", reward_key="score"), [s]))
    assert s.reward == {"score": 3.0, "acc": True, "pred": "abc"} and s.scalar_reward("score") == 3.0
    s = sample("abc")
    asyncio.run(reward_group(make_args(custom_rm_path=f"{plugins}.dict_rm"), [s]))
    assert s.status == Status.FAILED and "pass --reward-key" in s.metadata["failure"]
    s = sample("abc")
    asyncio.run(reward_group(make_args(custom_rm_path=f"{plugins}.dict_rm", reward_key="reward"), [s]))
    assert s.status == Status.FAILED and "no field 'reward' (--reward-key)" in s.metadata["failure"]
    s = sample("abc")
    asyncio.run(reward_group(make_args(custom_rm_path=f"{plugins}.dict_rm", reward_key="pred"), [s]))
    assert s.status == Status.FAILED and "field 'pred'" in s.metadata["failure"]
