"""The embedded engine on a CUDA GPU (skipped without one; benchmarks/gpu_check.sh runs these)."""

from __future__ import annotations

import pytest
import torch

from slime.backends.hf_engine.local_server import EngineServer
from hf_engine_reference import greedy_reference
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORDS = [str(i) for i in range(10)] + list("abcdefghij")
SPEC = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, max_position_embeddings=512)
# big enough that its weights span whole segments of the caching allocator (48 MB in bfloat16)
WIDE = TinyQwen3Spec(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=1024, max_position_embeddings=512, vocab_size=40000)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda_tiny")
    return d, build_tiny_qwen3(str(d), build_tokenizer(WORDS), SPEC, seed=0).eval()


def test_a_step_waits_for_the_device_only_when_its_tokens_come_back(tiny):
    from slime.backends.hf_engine.batch import PagedBatch
    from slime.backends.hf_engine.sampling import SamplingParams, prepare_sampling, sample_tokens, to_host

    model_dir, ref = tiny
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval().to("cuda")
    batch = PagedBatch(model, block_size=4, max_tokens=4096, max_rows=8, min_bucket_saving=8)
    seqs = {batch.add_row(): [1] + [3 + (i * 7 + j) % 15 for j in range(n)] for i, n in enumerate((40, 3, 17))}
    for row, seq in seqs.items():  # prefill in chunks of 16 (chunks with a prefix: the masked path)
        while batch.cached(row) < len(seq) - 1:
            take = min(16, len(seq) - 1 - batch.cached(row))
            batch.forward([(row, seq[batch.cached(row): batch.cached(row) + take], False)])
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logit_bias={4: 2.0}),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.3)]
    gen = torch.Generator()
    gen.manual_seed(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the device raises
    try:
        sb = prepare_sampling(params, [None, None, gen], torch.Generator(), ref.config.vocab_size, batch.device)
        logits = batch.forward([(row, seq[-1:], True) for row, seq in seqs.items()])
        tokens, logprobs = sample_tokens(logits, sb)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, logprobs = to_host(tokens, logprobs)
    with torch.no_grad():
        for i, seq in enumerate(seqs.values()):
            want = ref(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(logits[i].cpu(), want, atol=2e-4, rtol=0)
    assert tokens[1] == int(logits[1].argmax()) and all(lp <= 0 for lp in logprobs)


def test_engine_on_cuda_serves_the_references_greedy_tokens(tiny, tmp_path):
    model_dir, ref = tiny
    srv = EngineServer(model_dir, ["--device", "cuda", "--chunked-prefill-size", "8", "--seed", "0"],
                       log_path=str(tmp_path / "engine.log")).wait_healthy(300)
    try:
        info = srv.get("/get_server_info").json()
        assert info["device"] == "cuda" and info["dtype"] == "float32"  # auto: the checkpoint's dtype on a GPU
        prompts = [[1, 5, 6, 7, 8], [1] + [3 + j % 15 for j in range(20)], [1] + [4 + j % 13 for j in range(37)]]
        r = srv.post("/generate", {"input_ids": prompts, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                             "ignore_eos": True}}, timeout=120)
        assert r.status_code == 200, r.text
        for p, out in zip(prompts, r.json()):
            assert out["output_ids"] == greedy_reference(ref, p, 12)
    finally:
        srv.stop()


def test_bf16_engine_takes_cuda_ipc_updates_in_place_and_gives_released_memory_back(tmp_path):
    from slime.backends.training_utils.weight_sync.payload import dtype_buckets, flatten_bucket, serialize

    tok = build_tokenizer(WORDS)
    models = {}
    for seed, name in enumerate("ab"):
        build_tiny_qwen3(str(tmp_path / name), tok, WIDE, seed=seed)
        from transformers import AutoModelForCausalLM

        models[name] = AutoModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.bfloat16).to("cuda")
    srv = EngineServer(tmp_path / "a", ["--device", "cuda", "--dtype", "bfloat16", "--enable-memory-saver", "--seed", "0"],
                       log_path=str(tmp_path / "engine.log")).wait_healthy(300)

    def greedy():
        r = srv.post("/generate", {"input_ids": [1, 5, 6, 7, 8], "sampling_params": {
            "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}, timeout=120)
        return r.status_code, r.json().get("output_ids") if r.status_code == 200 else r.text

    def push(name, version):
        named = [(k, v.detach()) for k, v in models[name].state_dict().items()]
        assert all(t.is_cuda for _, t in named)  # CUDA IPC handles, not host copies
        with srv.weight_update_session():  # SGLang (0.5.21+) takes tensor updates only inside one
            for b in dtype_buckets(named, 16 << 20):
                flat = flatten_bucket(b)  # alive until the engine has copied it
                r = srv.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialize(flat)],
                                                              "load_format": "flattened_bucket",
                                                              "weight_version": str(version)}, timeout=120)
                assert r.status_code == 200 and r.json()["success"], r.text
                del flat

    def memory():
        return srv.get("/get_server_info").json()["internal_states"][0]["memory"]

    try:
        code, first = greedy()
        assert code == 200 and len(first) == 10
        push("b", 1)
        assert greedy()[1] != first
        push("a", 2)
        assert greedy()[1] == first  # A -> B -> A: the IPC tensors were copied into the weights exactly
        before = memory()
        assert before["device_reserved_bytes"] >= before["weight_bytes"] > 40 << 20
        r = srv.post("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
        assert r.json()["success"], r.text
        released = memory()
        assert released["weight_bytes"] == 0
        given_back = released["device_free_bytes"] - before["device_free_bytes"]
        assert given_back >= 0.9 * before["weight_bytes"], (before, released)
        assert srv.post("/resume_memory_occupation", {}).json()["success"]
        assert greedy()[0] == 503  # resumed without a backup: refused until the weights are written
        push("a", 3)
        assert greedy() == (200, first)
    finally:
        srv.stop()


def test_captured_decode_steps_replay_the_eager_steps_logits(tiny):
    """CUDA graphs (the default on cuda)."""
    from transformers import AutoModelForCausalLM

    from slime.backends.hf_engine.batch import PagedBatch

    model_dir, _ = tiny
    batches = {mode: PagedBatch(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval().to("cuda"),
                                block_size=4, max_tokens=4096, max_rows=16, decode_graphs=mode, graph_max_rows=8)
               for mode in ("off", "capture")}
    seqs = [[1] + [3 + (i * 5 + j) % 15 for j in range(n)] for i, n in enumerate((9, 2, 30))]
    rows = {mode: [b.add_row() for _ in seqs] for mode, b in batches.items()}
    with torch.no_grad():
        for mode, b in batches.items():
            for row, seq in zip(rows[mode], seqs):
                b.forward([(row, seq[:-1], False)])
        for t in range(12):
            out = {}
            for mode, b in batches.items():
                if mode == "capture" and t >= 2:  # shapes captured by now: a replay issues without waiting
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    out[mode] = b.forward([(row, seq[-1:], True) for row, seq in zip(rows[mode], seqs)])
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.testing.assert_close(out["capture"].float(), out["off"].float(), atol=2e-4, rtol=0)
            for seq, lg in zip(seqs, out["off"]):
                seq.append(int(lg.argmax()))
    graphs = batches["capture"].graphs
    assert graphs.steps == 12 and 1 <= graphs.captures <= 3  # three rows padded to 4; key blocks 4, then 8 or 16
