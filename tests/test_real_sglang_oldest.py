"""The oldest supported SGLang (0.5.15.post1, upstream slime's pin) generating on CPU."""

from __future__ import annotations

import pytest
import requests

from real_sglang import cmdline, engine_args, sglang_python
from test_fsdp_helpers import make_groups
from test_real_sglang import PROMPT, SPEC, sample_from, transformers_greedy

from slime.ray.buffer import PartialRolloutBuffer
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.sglang_rollout import engine_rollout, generate_rollout
from slime.tasks.subtract_chain import VOCAB, write_dataset
from slime.utils.ledger import TRAINED
from slime.utils.sglang_versions import SGLANG_OLDEST
from slime.utils.tiny_model import build_tiny_qwen3, build_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.real_sglang, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def env(tmp_path_factory, real_sglang_engines):
    root = tmp_path_factory.mktemp("real_sglang_oldest")
    tok = build_tokenizer(VOCAB)
    build_tiny_qwen3(str(root / "model"), tok, SPEC, seed=3)
    write_dataset(str(root / "prompts.jsonl"), 100, seed=0)
    args = engine_args(str(root / "model"), str(root / "prompts.jsonl"), str(root / "run"), "--rollout-batch-size",
                       "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "24", "--partial-rollout",
                       "--over-sampling-batch-size", "6", version=SGLANG_OLDEST)
    return {"root": root, "tok": tok, "args": args, "engines": real_sglang_engines(args)}


def test_the_oldest_sglang_serves_an_april_step_and_a_weight_update(env, make_trainer):
    group, args = env["engines"], env["args"]
    url = group.engine_urls[0]
    assert cmdline(group.engines[0].pid)[:3] == [sglang_python(SGLANG_OLDEST), "-m", "sglang.launch_server"]
    assert requests.get(url + "/server_info", timeout=30).json()["version"] == SGLANG_OLDEST
    assert requests.post(url + "/begin_weight_update", json={}, timeout=30).status_code == 404  # no sessions yet
    source, buffer = RolloutDataSource(args, env["tok"]), PartialRolloutBuffer(args)
    for step in range(2):
        out = generate_rollout(args, step, engine_rollout(args, buffer, source, group, policy_version=0).context())
        assert len(out.groups) == 2
        assert all(s.response_length == len(s.rollout_log_probs) > 0 for g in out.groups for s in g)
        assert all(sum(r["num_running_reqs"] + r["num_waiting_reqs"] for r in load["loads"]) == 0
                   for load in group.load().values())  # aborted until /v1/loads said idle
        buffer.mark([g[0].group_index for g in out.groups], TRAINED)
    buffer.check_balanced()
    # a broadcast update from the trainer, no session (404: none needed), then the new weights' greedy tokens
    t = make_trainer("fsdp", model_dir=str(env["root"] / "model"), lr=5e-2, update_weight_mode="distributed")
    t.train(0, make_groups(seed=1), 0)
    t.update_weights([url], 3)
    want = transformers_greedy({k: v.detach().clone() for k, v in t.updater.named_weights()},
                               str(env["root"] / "model"), PROMPT, 10)
    out = sample_from(url, n=10, temperature=0.0)
    assert out["output_ids"] == want and out["meta_info"]["weight_version"] == "3"
