"""The real model (SmolLM2-135M-Instruct, fp32) on SGLang's own server, started as a run starts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from real_model import QA, REPO, chat_prompt
from real_sglang import engine_args, record_cost, sglang_python
from test_real_sglang import trainer_log_probs, transformers_greedy

pytestmark = [pytest.mark.slow, pytest.mark.real_sglang, pytest.mark.real_model, pytest.mark.timeout(1200)]

# fp32, measured 2026-11-28 on the 2-core box: SGLang vs the trainer max |delta| 2.2e-5, mean 6.8e-6 over 4 x 32
# sampled tokens; a one-position shift of the tokens is ~0.1-1 off.
LOGPROB_BOUND = 1e-4


def _data(path) -> str:
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import convert_smollm2
    finally:
        sys.path.pop(0)
    return convert_smollm2.write_reasoning_gym(str(path), num=16, seed=0)


# ---- train.py ------------------------------------------------------------------------------------------------
def test_a_short_april_run_on_sglang_is_audit_clean(smollm2_dir, tmp_path):
    data = _data(tmp_path / "data.jsonl")
    argv = ["--hf-checkpoint", smollm2_dir, "--prompt-data", data, "--input-key", "prompt", "--label-key", "label",
            "--apply-chat-template", "--custom-rm-path", "tests.plugins_for_tests.token_id_reward",
            "--rollout-backend", "sglang", "--sglang-python", sglang_python(),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--over-sampling-batch-size", "4",
            "--partial-rollout", "--rollout-max-response-len", "16", "--global-batch-size", "4", "--num-rollout", "2",
            "--lr", "1e-5", "--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt")]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "train.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=1000,
                         env={**os.environ, "PYTHONPATH": REPO, "SLIME_SKIP_INSTALL": "1"})
    record_cost("train.py on SGLang, SmolLM2, 2 APRIL steps", time.monotonic() - t0)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["rollout/off_policy_tokens"] > 0  # APRIL trained what step 0 left over
    # step 0: every token came from the real weights; the trainer recomputed them
    d_max, d_mean = rows[0]["train/logprob_abs_diff_max"], rows[0]["train/logprob_abs_diff_mean"]
    print(f"train.py on SGLang, step 0: trainer vs SGLang log-probs max |delta| {d_max:.3g}, mean {d_mean:.3g} over "
          f"{rows[0]['rollout/trained_tokens']:.0f} tokens; rollout {rows[0]['rollout/tokens_per_s']:.1f} tokens/s")
    assert 0 < d_max <= LOGPROB_BOUND
    audit = subprocess.run([sys.executable, "tools/audit_ledger.py", str(tmp_path / "ckpt")], cwd=REPO,
                           capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert audit.returncode == 0 and ": clean; " in audit.stdout, audit.stdout + audit.stderr


# ---- one engine group and one trainer for the module ----------------------------------------------------------
@pytest.fixture(scope="module")
def env(smollm2_dir, tmp_path_factory, real_sglang_engines):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("real_model_sglang")
    args = engine_args(smollm2_dir, _data(root / "data.jsonl"), str(root / "run"), "--rm-type", "math",
                       "--input-key", "prompt", "--apply-chat-template")
    return {"engines": real_sglang_engines(args), "tok": AutoTokenizer.from_pretrained(smollm2_dir), "root": root}


@pytest.fixture(scope="module")
def trainer(smollm2_dir, env):
    from slime.backends.fsdp_utils.actor import FSDPTrainer

    from real_model import trainer_args

    # lr 1e-4: one step changes the greedy answer (the weight-update test)
    t = FSDPTrainer(trainer_args(smollm2_dir, env["root"], "fsdp", lr=1e-4, update_weight_mode="distributed"))
    t.init()
    yield t
    t.shutdown()


def generate(url: str, prompt: list[int], n: int, temperature: float) -> dict:
    r = requests.post(url + "/generate", json={"input_ids": prompt, "return_logprob": True,
                                               "sampling_params": {"max_new_tokens": n, "temperature": temperature}},
                      timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_sglang_logprobs_agree_with_the_trainers_recomputation_on_the_real_weights(env, trainer):
    url = env["engines"].engine_urls[0]
    assert requests.get(url + "/model_info", timeout=30).json()["weight_version"] == "0"  # as loaded
    prompts = [chat_prompt(env["tok"], q) for q, _ in QA]
    with ThreadPoolExecutor(len(prompts)) as pool:  # 4 in flight
        outs = list(pool.map(lambda p: generate(url, p, 32, 1.0), prompts))
    deltas, shifted = [], []
    for prompt, out in zip(prompts, outs):
        theirs = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        ours = trainer_log_probs(trainer, prompt, out["output_ids"])
        deltas.append((ours - theirs).abs())
        shifted.append(float((ours[1:] - theirs[:-1]).abs().max()))
    d = torch.cat(deltas)
    print(f"SmolLM2 on SGLang vs the FSDP trainer's recomputation: max |delta| {d.max():.3g}, mean {d.mean():.3g} "
          f"over {d.numel()} sampled tokens; one-position shift: min over samples {min(shifted):.3g}")
    assert d.max() <= LOGPROB_BOUND
    assert min(shifted) > 10 * LOGPROB_BOUND  # the bound would catch a shifted token


def test_after_a_weight_update_sglang_greedy_tokens_are_transformers(env, trainer, smollm2_dir):
    from real_model import chat_group

    url = env["engines"].engine_urls[0]
    prompt = chat_prompt(env["tok"], QA[0][0])
    before = generate(url, prompt, 16, 0.0)["output_ids"]
    trainer.train(0, [chat_group(env["tok"])], 0)
    metrics = trainer.update_weights(env["engines"].engine_urls, 7)
    assert metrics["weight_sync_from_disk"] == 0.0 and metrics["weight_sync_tensor"] == 0.0  # the broadcast group
    state = {k: v.detach().clone() for k, v in trainer.updater.named_weights()}
    want = transformers_greedy(state, smollm2_dir, prompt, 16)
    out = generate(url, prompt, 16, 0.0)
    assert out["meta_info"]["weight_version"] == "7"
    assert out["output_ids"] == want != before, (env["tok"].decode(before), env["tok"].decode(want))
