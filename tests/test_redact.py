"""Credentials never reach logs or the wandb config."""

from slime.utils.redact import MASK, is_secret_name, redact_argv, redact_flags, redact_url


def test_url_passwords_and_credential_query_values_are_masked():
    assert redact_url("http://alice:s3cr3t@rm.example:8000/score") == "http://alice:***@rm.example:8000/score"
    assert redact_url("POST https://u:p@h/x?api_key=abc&n=2 failed") == "POST https://u:***@h/x?api_key=***&n=2 failed"
    assert redact_url("http://127.0.0.1:30000/generate") == "http://127.0.0.1:30000/generate"


def test_flag_names_that_hold_credentials():
    for name in ("wandb_key", "sglang_extra_args.api-key", "--sglang-api-key", "hf_token", "rm_secret", "db-password"):
        assert is_secret_name(name), name
    for name in ("reward_key", "input_key", "label_key", "max_tokens_per_gpu", "rollout_stop_token_ids",
                 "n_samples_per_prompt"):
        assert not is_secret_name(name), name


def test_redact_flags_and_argv():
    flags = {"rm_url": "http://u:pw@h/", "reward_key": "score", "wandb_key": "k-123", "lr": 1e-6,
             "sglang_extra_args": {"api-key": "sk-1", "mem-fraction-static": "0.8"}, "rollout_stop_token_ids": [1, 2]}
    out = redact_flags(flags)
    assert out["rm_url"] == "http://u:***@h/" and out["reward_key"] == "score" and out["wandb_key"] == MASK
    assert out["sglang_extra_args"] == {"api-key": MASK, "mem-fraction-static": "0.8"}
    assert out["lr"] == 1e-6 and out["rollout_stop_token_ids"] == [1, 2]
    assert flags["wandb_key"] == "k-123"  # a copy
    argv = ["python", "-m", "sglang.launch_server", "--api-key", "sk-9", "--hf-token=t", "--model-path", "/m",
            "--url", "http://a:b@c"]
    assert redact_argv(argv) == ["python", "-m", "sglang.launch_server", "--api-key", MASK, f"--hf-token={MASK}",
                                 "--model-path", "/m", "--url", "http://a:***@c"]
