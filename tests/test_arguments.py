import json
import os
import pickle

import pytest

from slime.arguments import ArgumentError, parse_args


@pytest.fixture
def base(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1 1=", "label": "0"}) + "\n")
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "math",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "3"]


def test_defaults_are_derived(base):
    a = parse_args(base)
    assert a.over_sampling_batch_size == 4  # equal = synchronous
    assert a.global_batch_size == 8
    assert a.eps_clip_high == a.eps_clip == 0.2
    assert a.eval_temperature == a.rollout_temperature
    assert a.num_engines == 1
    assert a.rollout_pool_size == 512
    assert a.rollout_function_path == "slime.rollout.sglang_rollout.generate_rollout"
    assert a.wandb_mode == "offline" and a.use_wandb  # wandb offline by default, never online unless asked
    assert parse_args(base + ["--no-use-wandb"]).use_wandb is False
    assert parse_args(base + ["--use-wandb"]).use_wandb is True  # slime's spelling still works


def test_run_dir_default_is_written_at_parse_time(base, tmp_path):
    a = parse_args(base)
    runs = os.path.join(os.getcwd(), "runs") + os.sep
    assert a.run_dir.startswith(runs) and len(a.run_dir) > len(runs)  # <cwd>/runs/<date-time>, absolute
    assert parse_args(base + ["--run-dir", str(tmp_path)]).run_dir == str(tmp_path)


def test_every_path_flag_is_absolute_after_parsing(tmp_path, monkeypatch):
    """Ray workers on other nodes run in another working directory: a relative path would name another file."""
    (tmp_path / "model").mkdir()
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1 1=", "label": "0"}) + "\n")
    (tmp_path / "cost.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    a = parse_args(["--hf-checkpoint", "model", "--prompt-data", "./d.jsonl", "--rm-type", "math",
                    "--rollout-batch-size", "2", "--num-rollout", "1", "--save", "ckpt", "--load", "ckpt",
                    "--ref-load", "model", "--run-dir", "run", "--eval-prompt-data", "ev", "d.jsonl",
                    "--save-debug-rollout-data", "dump/r_{rollout_id}.json", "--over-sampling-batch-size", "auto",
                    "--rollout-cost-model", "cost.json"])
    t = str(tmp_path)
    assert (a.hf_checkpoint, a.prompt_data, a.save, a.load, a.ref_load, a.run_dir) == (
        f"{t}/model", f"{t}/d.jsonl", f"{t}/ckpt", f"{t}/ckpt", f"{t}/model", f"{t}/run")
    assert a.eval_prompt_data == ["ev", f"{t}/d.jsonl"] and a.eval_datasets == [("ev", f"{t}/d.jsonl")]
    assert a.save_debug_rollout_data == f"{t}/dump/r_{{rollout_id}}.json" and a.rollout_cost_model == f"{t}/cost.json"
    assert parse_args(["--hf-checkpoint", "~/../" + os.path.relpath(t, "/"), "--prompt-data", "d.jsonl",
                       "--rm-type", "math", "--rollout-batch-size", "2", "--num-rollout", "1"]).hf_checkpoint == \
        os.path.abspath(os.path.expanduser("~/../" + os.path.relpath(t, "/")))


def test_listen_host_values(base):
    assert parse_args(base).listen_host == "auto"  # loopback on one machine, each node's IP across machines
    for ok in ("127.0.0.1", "0.0.0.0", "10.1.2.3", "::1", "localhost", "lo"):
        assert parse_args(base + ["--listen-host", ok]).listen_host == ok
    with pytest.raises(ArgumentError, match=r"--listen-host: 'eth-nope' is neither auto.*interface of this machine.*lo"):
        parse_args(base + ["--listen-host", "eth-nope"])
    with pytest.raises(ArgumentError, match=r"--listen-host: is 127.0.0.1 \(loopback\) but --actor-num-nodes is 2"):
        parse_args(base + ["--listen-host", "127.0.0.1", "--actor-num-nodes", "2"])
    assert parse_args(base + ["--actor-num-nodes", "2"]).listen_host == "auto"


def test_args_are_read_only_and_picklable(base):
    a = parse_args(base)
    with pytest.raises(AttributeError, match="read-only"):
        a.lr = 1.0
    b = pickle.loads(pickle.dumps(a))
    assert b.rollout_batch_size == 4
    with pytest.raises(AttributeError):
        b.rollout_batch_size = 5
    c = a.replace(lr=3e-4)
    assert c.lr == 3e-4 and a.lr == 1e-6
    with pytest.raises(AttributeError):
        c.lr = 1.0


def test_sglang_pass_through(base):
    a = parse_args(base + ["--sglang-mem-fraction-static", "0.7", "--sglang-enable-memory-saver",
                           "--sglang-context-length=4096", "--sglang-server-concurrency", "16"])
    assert a.sglang_extra_args == {"mem-fraction-static": "0.7", "enable-memory-saver": True, "context-length": "4096"}
    assert a.sglang_server_concurrency == 16
    assert a.rollout_pool_size == 16


def test_unknown_flag_is_rejected(base):
    with pytest.raises(ArgumentError, match="--no-such-flag"):
        parse_args(base + ["--no-such-flag", "1"])


def test_eval_pairs(base, tmp_path):
    ev = tmp_path / "eval.jsonl"
    ev.write_text("{}\n")
    a = parse_args(base + ["--eval-prompt-data", "tiny", str(ev), "--eval-interval", "2"])
    assert a.eval_datasets == [("tiny", str(ev))]
    with pytest.raises(ArgumentError, match="--eval-prompt-data: takes name/path pairs"):
        parse_args(base + ["--eval-prompt-data", "tiny"])
    with pytest.raises(ArgumentError, match="--eval-interval"):
        parse_args(base + ["--eval-interval", "2"])


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--global-batch-size", "3"], "--global-batch-size"),
        (["--eps-clip-c", "0.5"], "--eps-clip-c"),
        (["--use-dynamic-batch-size"], "--max-tokens-per-gpu"),
        (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus"),
        (["--over-sampling-batch-size", "0"], "--over-sampling-batch-size"),
        (["--max-staleness", "-1"], "--max-staleness"),
        (["--save-interval", "2"], "--save-interval"),
        (["--debug-rollout-only", "--debug-train-only"], "--debug-rollout-only"),
        (["--rm-type", "remote_rm"], "--rm-url"),
        (["--offload"], "--offload"),  # without --colocate
        (["--update-weight-mode", "tensor"], "--update-weight-mode tensor"),  # without --colocate
        (["--update-weights-from-disk", "--update-weight-mode", "distributed"], "--update-weights-from-disk"),
        (["--colocate", "--rollout-num-gpus", "2"], "--rollout-num-gpus"),
        (["--train-backend", "megatron"], "--hf-checkpoint"),  # an empty dir: no config.json to build from
        (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size"),
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),  # fsdp (the CPU default)
        (["--rollout-top-p", "0"], "--rollout-top-p"),
        (["--tis-clip-low", "3"], "--tis-clip"),
        (["--load", "/nonexistent/ckpt"], "--load"),
        (["--lr", "inf"], "--lr"),
        (["--actor-num-gpus-per-node", "0"], "--actor-num-gpus-per-node"),
        (["--rollout-num-gpus", "0"], "--rollout-num-gpus"),
        (["--adam-beta2", "1.5"], "--adam-beta1"),
    ],
)
def test_rule_errors_name_the_flag(base, extra, flag):
    with pytest.raises(ArgumentError) as e:
        parse_args(base + extra)
    assert str(e.value).startswith(flag + ":")


def test_over_sampling_is_refused_where_it_would_be_ignored(base):
    # pool (and stream) mode keeps --rollout-pool-size requests in flight: a chunk size would do nothing
    with pytest.raises(ArgumentError, match="--over-sampling-batch-size: sizes --rollout-mode chunked.*--rollout-pool-size"):
        parse_args(base + ["--rollout-mode", "pool", "--over-sampling-batch-size", "8"])
    assert parse_args(base + ["--rollout-mode", "pool"]).rollout_mode == "pool"
    # auto's planner simulates one request per sample: a custom (multi-turn) generate is not what it models
    with pytest.raises(ArgumentError, match="--over-sampling-batch-size: auto plans with the rollout simulator"):
        parse_args(base + ["--over-sampling-batch-size", "auto", "--custom-generate-function-path", "m.generate"])


def test_required_inputs_named(tmp_path, base):
    with pytest.raises(ArgumentError, match="--hf-checkpoint: is required"):
        parse_args(base[2:])
    with pytest.raises(ArgumentError, match="--hf-checkpoint: '/nope' is not a directory"):
        parse_args(["--hf-checkpoint", "/nope"] + base[2:])
    no_data = [x for x in base]
    no_data[3] = str(tmp_path / "missing.jsonl")
    with pytest.raises(ArgumentError, match="--prompt-data: .*missing.jsonl' is not a file"):
        parse_args(no_data)


def test_over_sampling_modes(base):
    assert parse_args(base + ["--over-sampling-batch-size", "8", "--partial-rollout"]).over_sampling_batch_size == 8
    assert parse_args(base + ["--over-sampling-batch-size", "2"]).over_sampling_batch_size == 2


def test_train_async_flags_exist_only_for_train_async(base):
    a = parse_args(base, entry="train_async.py")
    assert a.max_async_lag == 1 and a.update_weights_interval == 1
    assert parse_args(base + ["--max-async-lag", "3", "--rollout-mode", "stream", "--partial-rollout"],
                      entry="train_async.py").max_async_lag == 3
    # train.py has no rollout running ahead: the flag is unknown there, and stream mode is refused by name
    with pytest.raises(ArgumentError, match="--max-async-lag"):
        parse_args(base + ["--max-async-lag", "2"])
    with pytest.raises(ArgumentError, match="^--rollout-mode stream: .*train_async.py"):
        parse_args(base + ["--rollout-mode", "stream", "--partial-rollout"])
    with pytest.raises(ValueError, match="unknown entry point"):
        parse_args(base, entry="nope.py")


def test_pause_mode_defaults_by_entry_and_is_refused_where_nothing_is_in_flight(base):
    from slime.arguments import ASYNC_PAUSE_MODE

    assert parse_args(base).pause_mode == "abort"
    assert parse_args(base, entry="train_async.py").pause_mode == ASYNC_PAUSE_MODE
    for mode in ("abort", "retract", "in_place"):
        assert parse_args(base + ["--pause-mode", mode], entry="train_async.py").pause_mode == mode
    with pytest.raises(ArgumentError, match="^--pause-mode in_place: train.py updates the weights of idle engines"):
        parse_args(base + ["--pause-mode", "in_place"])
    assert parse_args(base + ["--pause-mode", "abort"]).pause_mode == "abort"


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--max-async-lag", "0"], "--max-async-lag"),
        (["--update-weights-interval", "0"], "--update-weights-interval"),
        (["--update-weights-interval", "2"], "--max-async-lag"),  # the lag must cover the versions between updates
        (["--colocate"], "--colocate"),  # rollout and training overlap: they cannot share devices
        (["--use-fault-tolerance"], "--use-fault-tolerance"),  # engine restarts are train.py's
        (["--debug-train-only"], "--debug-train-only"),
        (["--debug-rollout-only"], "--debug-rollout-only"),
        (["--rollout-mode", "stream"], "--rollout-mode stream"),  # without --partial-rollout
        (["--rollout-mode", "stream", "--partial-rollout", "--rollout-function-path", "my.rollout"],
         "--rollout-function-path"),
    ],
)
def test_train_async_rules_name_the_flag(base, extra, flag):
    with pytest.raises(ArgumentError) as e:
        parse_args(base + extra, entry="train_async.py")
    assert str(e.value).startswith(flag + ":")


def test_pool_and_stream_admission_defaults(base):
    """auto (the engines' loads decide, at most concurrency x engines) unless a pool size is given."""
    stream = ["--rollout-mode", "stream", "--partial-rollout"]
    a = parse_args(base + stream, entry="train_async.py")
    assert (a.admission, a.rollout_pool_size) == ("auto", 512)
    a = parse_args(base + stream + ["--admission", "fixed"], entry="train_async.py")
    assert (a.admission, a.rollout_pool_size) == ("fixed", 4 * 2)  # --rollout-batch-size x --n-samples-per-prompt
    a = parse_args(base + stream + ["--rollout-pool-size", "6"], entry="train_async.py")
    assert (a.admission, a.rollout_pool_size) == ("fixed", 6)
    assert (parse_args(base + ["--rollout-mode", "pool"]).admission, parse_args(base).admission) == ("auto", "fixed")
    assert parse_args(base + ["--rollout-mode", "pool", "--admission", "auto", "--rollout-pool-size", "64"]).admission == "auto"
    with pytest.raises(ArgumentError, match="^--admission auto: .*--rollout-mode pool or stream"):
        parse_args(base + ["--admission", "auto"])


def test_update_weight_mode_defaults_and_slime_disk_flag(base):
    assert parse_args(base).update_weight_mode == "distributed"
    colo = parse_args(base + ["--colocate", "--offload"])
    assert (colo.update_weight_mode, colo.offload, colo.rollout_num_gpus) == ("tensor", True, 1)
    assert parse_args(base + ["--update-weights-from-disk"]).update_weight_mode == "disk"  # slime's flag
    assert parse_args(base + ["--colocate", "--update-weights-from-disk"]).update_weight_mode == "disk"
    assert parse_args(base + ["--colocate", "--update-weight-mode", "distributed"]).update_weight_mode == "distributed"
    # colocated engines span bundles: 4 devices, TP-2 engines -> 2 engines
    tp = parse_args(base + ["--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2"])
    assert (tp.rollout_num_gpus, tp.num_engines) == (4, 2)


def test_agent_flags_are_filled_with_agent_env_and_refused_without(base, base_args):
    a = parse_args(base + ["--agent-env", "slime.tasks.subtract_tool.ENV", "--max-tokens-per-turn", "64"])
    assert a.custom_generate_function_path == "slime.rollout.multi_turn.generate"
    assert (a.max_turns, a.tool_timeout, a.tool_workers, a.max_tokens_per_turn) == (16, 30.0, 4, 64)
    assert base_args.agent_env is None and base_args.max_turns is None and base_args.tool_timeout is None
    with pytest.raises(ArgumentError, match="--max-turns: needs --agent-env"):
        parse_args(base + ["--max-turns", "4"])
    with pytest.raises(ArgumentError, match="--agent-env: runs the built-in multi-turn generate"):
        parse_args(base + ["--agent-env", "slime.tasks.subtract_tool.ENV",
                           "--custom-generate-function-path", "tests.plugins_for_tests.tool_turn_generate"])
    with pytest.raises(ArgumentError, match="--tool-timeout: must be > 0"):
        parse_args(base + ["--agent-env", "slime.tasks.subtract_tool.ENV", "--tool-timeout", "0"])


def test_megatron_exit_flags_are_taken_and_checked(base):
    """Megatron-LM's --exit-duration-in-mins / --exit-interval (upstream scripts pass them): honoured, not refused."""
    args = parse_args(base + ["--exit-duration-in-mins", "230", "--exit-interval", "20"])
    assert (args.exit_duration_in_mins, args.exit_interval) == (230, 20)
    for flag in ("--exit-duration-in-mins", "--exit-interval"):
        with pytest.raises(ArgumentError, match=f"{flag}: must be > 0"):
            parse_args(base + [flag, "0"])
