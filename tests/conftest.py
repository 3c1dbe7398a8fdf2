import os

# Keep every test offline and on loopback.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "runs", "tiny")


@pytest.fixture(scope="session")
def parse_with(tmp_path_factory):
    """`parse_with(**flags)`: `slime.arguments.parse_args` on the minimal valid command line plus `flags`, checked
    as a user's would be (`reward_timeout=0.5` is `--reward-timeout 0.5`, True the bare flag, None leaves it out)."""
    from slime.arguments import parse_args

    d = tmp_path_factory.mktemp("base_args")
    (d / "hf").mkdir()
    (d / "prompts.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    base = dict(hf_checkpoint=d / "hf", prompt_data=d / "prompts.jsonl", rm_type="math", rollout_batch_size=1,
                num_rollout=1, run_dir=d / "run")

    def parse(**flags):
        argv = []
        for key, value in {**base, **flags}.items():
            if value is True:
                argv.append("--" + key.replace("_", "-"))
            elif value is not None and value is not False:
                argv += ["--" + key.replace("_", "-"), str(value)]
        return parse_args(argv)

    return parse


@pytest.fixture(scope="session")
def base_args(parse_with):
    """Parsed default flags (the minimal valid command line). Tests change what they need with
    `base_args.replace(flag=value)`: only real flags can be set (a misspelt name raises), and every other value is
    the parser's own default."""
    return parse_with()


@pytest.fixture(scope="session")
def quickstart_task():
    """runs/tiny: the quick start's task and warm-started model, built as scripts/quickstart.sh builds it (cached:
    the tool returns at once when it is there; concurrent callers wait on its lock), so the end-to-end tests run on
    a fresh clone too. Tests that run scripts/quickstart.sh ask for it first, so that only this fixture builds it."""
    import subprocess
    import sys

    subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_tiny_task.py"), "--out", TINY], cwd=REPO,
                   check=True, timeout=1800)
    return TINY


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an fp32 HF directory (tests/real_model.py), cached in runs/smollm2/model, read-only."""
    from real_model import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The trainer tests' tiny random Qwen3 (test_fsdp_helpers.make_model_dir), built once, shared read-only."""
    from test_fsdp_helpers import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture
def make_trainer(tiny_model_dir):
    """`make_trainer(backend, *argv, model_dir=None, **over)`: an initialised FSDP or Megatron-core trainer with
    real parsed flags (tests/test_fsdp_helpers.py's make_args: `argv` more flags, `over` replaced values) on the
    tiny model (or `model_dir`); every trainer made is shut down after the test. One fixture for both backends."""
    from test_fsdp_helpers import make_args

    made = []

    def _make(backend: str, *argv: str, model_dir=None, **over):
        args = make_args(str(model_dir or tiny_model_dir), "--train-backend", backend, *argv, **over)
        if backend == "fsdp":
            from slime.backends.fsdp_utils.actor import FSDPTrainer

            t = FSDPTrainer(args)
        else:
            from slime.backends.megatron_utils.actor import MegatronTrainer

            t = MegatronTrainer(args)
        t.init()
        made.append(t)
        return t

    yield _make
    for t in made:
        t.shutdown()


@pytest.fixture(scope="module")
def start_engine(tmp_path_factory):
    """`start_engine(model_dir, *flags)`: the embedded engine (`python -m slime.backends.hf_engine`) serving
    `model_dir` on a free loopback port, healthy. One fixture for every engine test module: each engine started
    is stopped after the module, which fails unless it exited cleanly (its log's tail in the message); a test may
    stop it itself first (another signal, a crash it provokes and checks)."""
    from slime.backends.hf_engine.local_server import EngineServer

    started = []

    def _start(model_dir, *flags: str) -> EngineServer:
        log = tmp_path_factory.mktemp("engine_log") / "engine.log"
        srv = EngineServer(model_dir, list(flags), log_path=str(log)).wait_healthy()
        started.append((srv, log))
        return srv

    yield _start
    for srv, log in started:
        rc = srv.stop()
        assert rc == 0, f"engine exited with {rc}:\n" + log.read_text()[-3000:]


@pytest.fixture(scope="module")
def real_sglang_engines(tmp_path_factory):
    """`real_sglang_engines(args)`: an EngineGroup of real SGLang servers (`args` from
    `real_sglang.engine_args(...)`: `--rollout-backend sglang` from the CPU venv), started behind the real
    sglang-router; every group started is shut down after the module. One group per module: a start costs
    75-100 s here."""
    from real_sglang import start_engines

    started = []

    def _start(args):
        group = start_engines(args, str(tmp_path_factory.mktemp("real_sglang_logs")))
        started.append(group)
        return group

    yield _start
    for group in started:
        group.shutdown()


def pytest_runtest_logreport(report):
    """The real-SGLang group's cost, test by test (set-up: its engines' start), into real_sglang.COSTS (scripts/test.sh
    prints it); recorded once, by the process that reports (the xdist controller, or the only process)."""
    if report.when in ("setup", "call") and "real_sglang" in report.keywords and "PYTEST_XDIST_WORKER" not in os.environ:
        from real_sglang import record_cost

        record_cost(f"{report.when} {report.nodeid}", report.duration, outcome=report.outcome)


def pytest_collection_modifyitems(config, items):
    """`real_model` tests are skipped only when asked (SLIME_SKIP_REAL_MODEL=1); without their packages they fail.

    Whole files go to the two workers (scripts/test.sh: --dist loadfile --no-loadscope-reorder) in this order: the
    slow files first, so that the run does not end on one long file while the other worker idles; among them, those
    that wait for a build (the warm-started quick-start task, SGLang's venv, the converted real model) last, so that
    their builds are done by then; the fast files after, those with the most tests first (xdist's own order)."""
    if os.environ.get("SLIME_SKIP_REAL_MODEL") == "1":
        skip = pytest.mark.skip(reason="SLIME_SKIP_REAL_MODEL=1: real-model tests skipped")
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)
    slow, waits, count = set(), set(), {}
    for item in items:
        module = item.nodeid.split("::")[0]
        count[module] = count.get(module, 0) + 1
        if item.get_closest_marker("slow") is not None:
            slow.add(module)
        if "quickstart_task" in item.fixturenames or any(item.get_closest_marker(m) for m in ("real_sglang", "real_model")):
            waits.add(module)

    def rank(item) -> tuple[int, int]:
        module = item.nodeid.split("::")[0]
        return (1, 0) if module in waits else (0, 0) if module in slow else (2, -count[module])

    items.sort(key=rank)  # stable: a file's tests keep their order


def pytest_collection_finish(session):
    """The quick start's warm start (~2-4 min of one core) starts building in the background as soon as a selected
    test needs it; the first worker that gets such a test then waits only for what is left. One process starts it
    (the only one, or the first xdist worker); the tool's lock makes any other caller wait for it."""
    import subprocess
    import sys

    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or session.config.option.collectonly:
        return
    if any("quickstart_task" in item.fixturenames for item in session.items):
        os.makedirs(os.path.dirname(TINY), exist_ok=True)
        subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "prepare_tiny_task.py"), "--out", TINY],
                         cwd=REPO, stdout=open(TINY + ".log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
