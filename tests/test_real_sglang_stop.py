"""A polite stop on SGLang's own server (`sglang.launch_server`, SGLang 0.5.23 on CPU)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from real_sglang import REPO, record_cost, sglang_python
from test_faults import _env, task  # noqa: F401 - `task` is a fixture
from test_graceful_stop import _chain_cmd, _stopped_run, check_resumes, check_stop

pytestmark = [pytest.mark.slow, pytest.mark.real_sglang, pytest.mark.timeout(1500)]
STEPS = 3


@pytest.fixture(scope="module")
def chain(task, tmp_path_factory):
    sglang = ("--rollout-backend", "sglang", "--sglang-python", sglang_python(), "--rollout-max-response-len", "32")
    d = tmp_path_factory.mktemp("sglang_stop")
    (d / "train.jsonl").symlink_to(task[0] / "train.jsonl")
    t0 = time.monotonic()
    run = _stopped_run(d, "train.py", "chunked", "rollout", signal.SIGTERM, 0, sglang, steps=STEPS)
    run.update(entry="train.py", mode="chunked", phase="rollout", sig=signal.SIGTERM)
    final = subprocess.run(_chain_cmd(d, "train.py", "chunked", "--load", str(d / "ckpt"), *sglang, steps=STEPS),
                           cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    record_cost("a SIGTERM'd train.py run and its --load resume, 3 steps", time.monotonic() - t0)
    return {"d": d, "entry": "train.py", "runs": [run], "final": final, "end": STEPS - 1}


def test_a_stop_on_sglang_checkpoints_says_why_and_leaves_nothing_behind(chain):
    check_stop(chain, chain["runs"][0])
    assert any("sglang.launch_server" in c for c in chain["runs"][0]["job_cmds"])


def test_the_resume_on_sglang_takes_the_parked_samples_first_and_the_ledger_audit_passes(chain):
    check_resumes(chain)
