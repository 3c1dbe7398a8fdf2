"""Real parsed flags for the reward tests (tests/test_rm_hub.py, tests/test_rm_plugins.py) and a sample to score."""

from __future__ import annotations

import pytest

from slime.arguments import parse_args
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
