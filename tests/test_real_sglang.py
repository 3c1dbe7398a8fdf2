"""The rollout path judged by SGLang's own server."""

from __future__ import annotations

import copy

import pytest
import requests
import torch

from pause_reference import ReplyLog, cache_key_scenario, pause_scenario
from real_sglang import abort_mid_way, cmdline, compare, engine_args, shape, sglang_python
from test_fsdp_helpers import make_groups

from slime.backends.sglang_utils import http_client
from slime.backends.training_utils.data import flatten_groups
from slime.ray.buffer import PartialRolloutBuffer
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.sglang_rollout import engine_rollout, generate_rollout
from slime.tasks.subtract_chain import VOCAB, write_dataset
from slime.utils.ledger import TRAINED
from slime.utils.sglang_versions import SGLANG_PINNED
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer
from slime.utils.types import Status

pytestmark = [pytest.mark.slow, pytest.mark.real_sglang, pytest.mark.timeout(900)]
SPEC = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=128, max_position_embeddings=256)
PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def env(tmp_path_factory, real_sglang_engines):
    root = tmp_path_factory.mktemp("real_sglang")
    tok = build_tokenizer(VOCAB)
    build_tiny_qwen3(str(root / "model"), tok, SPEC, seed=3)
    write_dataset(str(root / "prompts.jsonl"), 300, seed=0)
    args = rollout_args(root)
    return {"root": root, "tok": tok, "model_dir": str(root / "model"), "engines": real_sglang_engines(args)}


def rollout_args(root, *extra, entry: str = "train.py"):
    return engine_args(str(root / "model"), str(root / "prompts.jsonl"), str(root / "run"), "--rollout-batch-size",
                       "3", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "24",
                       "--sglang-server-concurrency", "6", "--rollout-seed", "7", *extra, engines=2, entry=entry)


def set_version(engines, version: int) -> None:
    for url in engines.worker_urls():
        r = requests.post(url + "/update_weight_version", json={"new_version": str(version)}, timeout=60)
        assert r.json()["success"], r.text


def generate(url: str, body: dict) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


# ---- the engines ------------------------------------------------------------------------------------
def test_engines_are_sglang_launch_server_processes_behind_the_router(env):
    group = env["engines"]
    assert group.backend == "sglang" and len(group.engines) == 2
    for engine in group.engines:
        argv = cmdline(engine.pid)
        assert argv[:3] == [sglang_python(), "-m", "sglang.launch_server"], argv
        assert argv[argv.index("--port") + 1] == engine.url.rsplit(":", 1)[1]
        info = requests.get(engine.url + "/server_info", timeout=30).json()
        assert info["version"] == SGLANG_PINNED and info["device"] == "cpu"
    assert group.worker_urls() == sorted(group.engine_urls)


# ---- 3a: the APRIL step ------------------------------------------------------------------------------
class Recorder:
    """Every /generate body the rollout sent and SGLang's reply to it, in order."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[dict, dict]] = []
        real = http_client.generate

        async def recording(session, url, payload, timeout=None, **kw):
            out = await real(session, url, payload, timeout=timeout, **kw)
            self.calls.append((copy.deepcopy(payload), copy.deepcopy(out)))
            return out

        monkeypatch.setattr(http_client, "generate", recording)

    def segment_ending(self, index: int, tokens: list[int]) -> tuple[dict, dict]:
        """Sample `index`'s request with output whose input + output is `tokens`."""
        hits = [(p, o) for p, o in self.calls
                if f"-s{index}-" in p["rid"] and o["output_ids"] and p["input_ids"] + o["output_ids"] == tokens]
        assert len(hits) == 1, f"{len(hits)} requests of sample {index} end at {tokens}"
        return hits[0]


def test_april_steps_on_real_engines_park_what_sglang_returned_and_resume_it(env, monkeypatch, tmp_path):
    group = env["engines"]
    rec = Recorder(monkeypatch)
    args = rollout_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "6", "--run-dir", str(tmp_path))
    source, buffer = RolloutDataSource(args, env["tok"]), PartialRolloutBuffer(args)
    parked_seen: dict[int, tuple[list[int], list[float], list[int]]] = {}  # sample index -> tokens, lps, versions
    resumed = trained_spanning = 0
    for step in range(10):
        set_version(group, step)
        out = generate_rollout(args, step, engine_rollout(args, buffer, source, group, policy_version=step).context())
        # the step ended with every engine idle: the abort went through the fan-out until /v1/loads said so
        assert all(sum(r["num_running_reqs"] + r["num_waiting_reqs"] for r in load["loads"]) == 0
                   for load in group.load().values())
        assert len(out.groups) == 3
        for g in out.groups:
            for s in g:
                assert len(s.rollout_log_probs) == len(s.weight_versions) == s.response_length > 0
                assert s.weight_versions == sorted(s.weight_versions) and s.weight_versions[-1] <= step
                # the trained sample is the concatenation of what SGLang returned, segment by segment
                tokens, lps, versions = list(s.tokens), list(s.rollout_log_probs), list(s.weight_versions)
                while len(tokens) > s.prompt_length:
                    payload, reply = rec.segment_ending(s.index, tokens)
                    ids = reply["output_ids"]
                    assert [x[1] for x in reply["meta_info"]["output_token_logprobs"]] == ids
                    assert lps[-len(ids):] == [x[0] for x in reply["meta_info"]["output_token_logprobs"]]
                    assert versions[-len(ids):] == [int(reply["meta_info"]["weight_version"])] * len(ids)
                    tokens, lps, versions = payload["input_ids"], lps[:-len(ids)], versions[:-len(ids)]
                assert tokens == s.tokens[: s.prompt_length]
                if s.index in parked_seen:  # resumed from prompt + the parked partial tokens, and finished
                    p_tokens, p_lps, p_versions = parked_seen.pop(s.index)
                    assert s.tokens[: len(p_tokens)] == p_tokens and s.response_length > len(p_tokens) - s.prompt_length
                    assert s.rollout_log_probs[: len(p_lps)] == p_lps and s.weight_versions[: len(p_versions)] == p_versions
                    assert any(p["input_ids"] == p_tokens for p, _ in rec.calls)
                    resumed += 1
                    trained_spanning += len(set(s.weight_versions)) > 1
        buffer.mark([g[0].group_index for g in out.groups], TRAINED)
        # every parked sample holds exactly what SGLang returned for it: tokens, log-probs, the aborted reply
        for g in buffer._parked:
            for s in g:
                if s.response_length and s.status == Status.ABORTED:
                    payload, reply = rec.segment_ending(s.index, list(s.tokens))
                    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
                    # an abort that arrived with the EOS finished the sample: it is never parked (it would run on)
                    assert s.tokens[-1] != env["tok"].eos_token_id
                    n = len(reply["output_ids"])
                    assert s.rollout_log_probs[-n:] == [x[0] for x in reply["meta_info"]["output_token_logprobs"]]
                    parked_seen[s.index] = (list(s.tokens), list(s.rollout_log_probs), list(s.weight_versions))
        buffer.check_balanced()  # the ledger audit: every issued group in exactly one state
        if resumed and trained_spanning:
            break
    assert resumed and trained_spanning, f"no parked partial sample was resumed and trained ({resumed}, {trained_spanning})"
    summary = buffer.check_balanced()
    assert summary["total"] == source.state_dict()["group_counter"]


# ---- 3b / 3c: weights from the trainers -----------------------------------------------------------------
def sample_from(url: str, prompt=PROMPT, n: int = 12, temperature: float = 1.0) -> dict:
    return generate(url, {"input_ids": prompt, "return_logprob": True,
                          "sampling_params": {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True}})


def trainer_log_probs(trainer, prompt: list[int], ids: list[int]) -> torch.Tensor:
    from slime.backends.fsdp_utils.actor import FSDPTrainer
    from slime.utils.types import Sample

    s = Sample(index=0, group_index=0, tokens=list(prompt), reward=0.0)
    s.append_response(ids, [0.0] * len(ids), 0)
    items = [it for g in flatten_groups([[s]])[0] for it in g]
    policy = trainer.model if isinstance(trainer, FSDPTrainer) else trainer.actor
    return trainer._log_probs(policy, items)[0].detach()


# measured on the 2-core box (fp32, this model, 4 prompts x 12 sampled tokens): max |delta| ~1e-6 for both
# trainers; a one-position shift of the tokens gives |delta| ~0.1-1. The bound sits well between.
LOGPROB_BOUND = 1e-4


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_sglang_logprobs_agree_with_the_trainers_recomputation(env, make_trainer, backend):
    t = make_trainer(backend, model_dir=env["model_dir"], lr=1e-2)
    version = 100 + (backend == "megatron")
    t.train(0, make_groups(seed=7), 0)  # weights the engines have never had
    t.update_weights(env["engines"].engine_urls, version)
    deltas, shifted = [], []
    for i, url in enumerate(env["engines"].engine_urls * 2):
        prompt = PROMPT[: 2 + i]
        out = sample_from(url, prompt)
        assert out["meta_info"]["weight_version"] == str(version)
        lps = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        ours = trainer_log_probs(t, prompt, out["output_ids"])
        deltas.append((ours - lps).abs())
        shifted.append((ours[1:] - lps[:-1]).abs().max())  # what a token shifted by one position would look like
    d = torch.cat(deltas)
    print(f"log-prob agreement, SGLang vs the {backend} trainer: max |delta| {d.max():.3g}, mean {d.mean():.3g} "
          f"over {d.numel()} tokens; one-position shift: min over samples {min(shifted):.3g}")
    assert d.max() <= LOGPROB_BOUND
    assert min(shifted) > 10 * LOGPROB_BOUND  # the bound would catch a shift


def transformers_greedy(state: dict, model_dir: str, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("mode", ["distributed", "disk", "tensor"])
def test_weight_updates_in_sglang_sessions_serve_the_new_weights(env, make_trainer, mode):
    """Each mode through SGLang's own weight-update session."""
    t = make_trainer("fsdp", model_dir=env["model_dir"], lr=5e-2, update_weight_mode=mode)
    version = {"distributed": 201, "disk": 202, "tensor": 203}[mode]
    t.train(0, make_groups(seed=version), 0)
    urls = env["engines"].engine_urls
    before = [sample_from(u, n=10, temperature=0.0)["output_ids"] for u in urls]
    metrics = t.update_weights(urls, version)
    state = {k: v.detach().clone() for k, v in t.updater.named_weights()}
    want = transformers_greedy(state, env["model_dir"], PROMPT, 10)
    for url in urls:
        out = sample_from(url, n=10, temperature=0.0)
        assert out["output_ids"] == want and out["meta_info"]["weight_version"] == str(version)
        assert requests.get(url + "/model_info", timeout=30).json()["weight_version"] == str(version)
    assert metrics["weight_sync_from_disk"] == float(mode == "disk")
    assert before != [want, want] or mode != "distributed"  # (the new weights change the greedy tokens here)
    # the engines are alive and serve generation after the session closed
    assert all(requests.get(u + "/health_generate", timeout=120).status_code == 200 for u in urls)


# ---- 3g: the embedded engine judged by the real one ----------------------------------------------------------
def test_embedded_engine_answers_as_sglang_does(env, start_engine, tmp_path):
    real = env["engines"].engine_urls[0]
    emb = start_engine(env["model_dir"], "--weight-version", "0").url
    for url in (real, emb):  # the same weights and version on both (other tests may have changed the real ones)
        r = requests.post(url + "/update_weights_from_disk", json={"model_path": env["model_dir"], "weight_version": "5"},
                          timeout=300)
        assert r.json()["success"], r.text
    greedy = {"input_ids": PROMPT, "return_logprob": True,
              "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    a, b = generate(real, greedy), generate(emb, greedy)
    compare(a, b, "greedy with log-probs")
    assert a["meta_info"]["weight_version"] == b["meta_info"]["weight_version"] == "5"
    compare(generate(real, {**greedy, "return_logprob": False}), generate(emb, {**greedy, "return_logprob": False}),
            "greedy without log-probs")
    # a stop string: the text of the third greedy token ends the request there
    stop = env["tok"].decode([a["output_ids"][2]])
    body = {**greedy, "sampling_params": {**greedy["sampling_params"], "stop": [stop]}}
    x, y = generate(real, body), generate(emb, body)
    assert x["meta_info"]["finish_reason"]["type"] == "stop"
    compare(x, y, f"stop string {stop!r}")
    # max_new_tokens 0: the prompt scored, nothing sampled
    body = {**greedy, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}
    compare(generate(real, body), generate(emb, body), "max_new_tokens 0")
    # resume from tokens: prompt + the first 4 greedy tokens continue as the uninterrupted request did
    body = {**greedy, "input_ids": PROMPT + a["output_ids"][:4],
            "sampling_params": {**greedy["sampling_params"], "max_new_tokens": 4}}
    x, y = generate(real, body), generate(emb, body)
    assert x["output_ids"] == a["output_ids"][4:]
    compare(x, y, "resume from tokens")
    # abort mid-way: the partial reply (how far each got is timing: shapes and the finish reason compared)
    x, y = abort_mid_way(real, "abort-real", PROMPT), abort_mid_way(emb, "abort-embedded", PROMPT)
    assert x["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert 0 < len(x["output_ids"]) < 200
    assert y["meta_info"]["finish_reason"] == x["meta_info"]["finish_reason"]
    compare(x, y, "aborted", same_tokens=False)
    n = min(len(x["output_ids"]), len(y["output_ids"]))
    assert x["output_ids"][:n] == y["output_ids"][:n]  # greedy: the same tokens as far as both got
    # a weight update (disk), then generate: the new weights and version on both
    build_tiny_qwen3(str(tmp_path / "model2"), env["tok"], SPEC, seed=11)
    for url in (real, emb):
        r = requests.post(url + "/update_weights_from_disk",
                          json={"model_path": str(tmp_path / "model2"), "weight_version": "6"}, timeout=300)
        assert r.json()["success"], r.text
    x, y = generate(real, greedy), generate(emb, greedy)
    assert x["meta_info"]["weight_version"] == "6" and x["output_ids"] != a["output_ids"]
    compare(x, y, "after a weight update")
    info_real = requests.get(real + "/model_info", timeout=30).json()
    info_emb = requests.get(emb + "/model_info", timeout=30).json()
    assert info_emb["weight_version"] == info_real["weight_version"] == "6"
    # SGLang's embedding-model settings block: the embedded engine serves no embedding model (docs/sglang-compat.md)
    assert shape({k: v for k, v in info_real.items() if k != "embedding"}) == shape(info_emb)


# ---- 3d: stream mode across weight updates -----------------------------------------------------------------
@pytest.mark.parametrize("pause", ["abort", "retract", "in_place"])
def test_stream_rollout_across_weight_updates_keeps_every_tokens_version(env, monkeypatch, request, pause):
    """train_async.py's stream rollout on real engines, weights switching mid-request, for each --pause-mode.

    Each token carries SGLang's span version and that version's teacher-forced log-prob (in_place: bar old KV)."""
    import ray
    from transformers import AutoModelForCausalLM

    from logprob_reference import teacher_forced
    from slime.ray.async_rollout import AsyncRollout
    from slime.ray.rollout import RolloutManager
    from slime.utils.run import init_ray

    root, group = env["root"], env["engines"]
    if not (root / "B").exists():
        build_tiny_qwen3(str(root / "B"), env["tok"], SPEC, seed=4)
    paths = {"A": env["model_dir"], "B": str(root / "B")}
    models = {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in paths.items()}
    flags = ("--rollout-mode", "stream", "--rollout-max-response-len", "32", "--rollout-ignore-eos",
             "--sglang-server-concurrency", "8", "--rollout-pool-size", "6", "--partial-rollout",
             "--max-async-lag", "40", "--num-rollout", "50", "--pause-mode", pause)
    args = rollout_args(root, *flags, "--run-dir", str(root / f"run_stream_{pause}"), entry="train_async.py")
    log = ReplyLog(monkeypatch)
    weights = {v: "AB"[v % 2] for v in range(20)}
    group.weights.from_disk(paths["A"], 0)
    if not ray.is_initialized():  # ours: not left to the next module in this worker (it may need more CPUs)
        init_ray(num_cpus=2)
        request.addfinalizer(ray.shutdown)
    manager = RolloutManager(args, str(root / f"run_stream_{pause}"), start_engines=False)
    manager.attach_engines(group)
    rollout = AsyncRollout(args, manager, 0).start()
    batches, across = [], 0
    try:
        for step in range(12):
            batches.append(rollout.next_batch(step))
            manager.mark_trained(batches[-1].groups)
            with rollout.updating_weights(step + 1) as flush:  # abort: the gate drains ours; else the engines hold
                replies = group.weights.from_disk(paths[weights[step + 1]], step + 1, flush_cache=flush)  # them
            assert all(r["success"] for r in replies.values()), replies
            manager.set_policy_version(step + 1)
            spanning = [s for b in batches for g in b.groups for s in g if len(set(s.weight_versions)) > 1]
            across = sum(len(log.crossed(s, overlap=True)) > 0 for b in batches for g in b.groups for s in g)
            held_across = rollout.gate.pauses_by_reason["update"] >= 2 if pause == "abort" else across > 0
            if step >= 2 and held_across and spanning:
                break
    finally:
        rollout.stop()
    if pause == "abort":  # updates found requests of ours in flight, and drained them
        assert rollout.gate.pauses_by_reason["update"] >= 2
    else:  # nothing aborted for an update: SGLang held requests across them, its spans split their tokens
        assert rollout.gate.pauses_by_reason["update"] == 0 and across > 0
    summary = ray.get(manager.buffer.check_balanced.remote(), timeout=60)
    assert summary["issued"] == 0
    samples = [s for b in batches for g in b.groups for s in g]
    assert any(len(set(s.weight_versions)) > 1 for s in samples), "no sample resumed across an update"
    assert all(b.metrics["rollout/version_disagreements"] == 0 for b in batches)
    wrong = checked = 0
    for s in samples:
        under = {k: teacher_forced(m, s) for k, m in models.items()}
        crossed = log.crossed(s, overlap=True) if pause == "in_place" else set()
        for i, v in enumerate(s.weight_versions):
            if i in crossed:
                continue
            assert under[weights[v]][i] == pytest.approx(s.rollout_log_probs[i], abs=1e-4), (s.index, i, v)
            wrong += abs(under["B" if weights[v] == "A" else "A"][i] - s.rollout_log_probs[i]) > 1e-2
            checked += 1
    assert wrong > checked // 2  # the two models differ: a mislabelled token would be caught


# ---- 3e: pauses, spans and cache keys, SGLang's and the embedded engine's ----------------------------------
def test_pauses_spans_and_cache_keys_on_sglang_and_the_embedded_engine_alike(env, start_engine, tmp_path):
    """SGLang's own server and the embedded engine answer the pause scenarios alike and as the models say."""
    from transformers import AutoModelForCausalLM

    build_tiny_qwen3(str(tmp_path / "B"), env["tok"], SPEC, seed=21)
    dirs = {"A": env["model_dir"], "B": str(tmp_path / "B")}
    models = {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in dirs.items()}
    real = env["engines"].engine_urls[0]
    emb = start_engine(env["model_dir"], "--seed", "0").url
    theirs, ours = pause_scenario(real, dirs, models, PROMPT), pause_scenario(emb, dirs, models, PROMPT)
    # SGLang's overlap scheduler: a token in flight at an in-place pause (usually one) is the old weights', after the
    # boundary (our client labels it so: engine_versions.lag_spans); the embedded engine has no step in flight
    assert theirs.pop("in_place_old_tokens_past_the_boundary") in (0, 1)
    assert ours.pop("in_place_old_tokens_past_the_boundary") == 0
    # after an update whose flush was refused, SGLang's scheduler labels new tokens with the new version but its
    # tokenizer side (/model_info) keeps the old one (it records a version only on success); ours has one version
    assert (theirs.pop("in_place_loaded_anyway"), ours.pop("in_place_loaded_anyway")) == ("30", "31")
    assert theirs == ours, (theirs, ours)
    assert theirs["in_place_update_with_flush"][:2] == (400, False)
    assert theirs["in_place_update"] and theirs["in_place_flush"] == 400 and theirs["in_place_spans"] == 2
    assert theirs["retract_update"] and theirs["retract_flush"] == 200 and theirs["retract_num_retractions"] == 1
    assert theirs["abort_finish"]["type"] == "abort" and theirs["abort_holds_new_requests"]
    theirs, ours = cache_key_scenario(real, dirs, models, PROMPT), cache_key_scenario(emb, dirs, models, PROMPT)
    assert theirs == ours == {"new_key_cached": 0, "old_key_cached": True, "old_key_is_old_kv": True,
                              "aborted_at": True}, (theirs, ours)
    requests.post(real + "/update_weights_from_disk", json={"model_path": dirs["A"], "weight_version": "0"}, timeout=300)
