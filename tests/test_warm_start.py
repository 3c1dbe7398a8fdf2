import json
import os
import random
import sys

import pytest
import torch

from slime.tasks import subtract_chain as task
from slime.tasks.warm_start import WarmStartConfig, collate, encode_example, evaluate, sample_batch, train_warm_start
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import prepare_tiny_task  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(task.VOCAB)


@pytest.fixture()
def model(tmp_path, tok):
    torch.set_num_threads(1)
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    return build_tiny_qwen3(str(tmp_path / "init"), tok, spec, seed=0).eval()


def test_collate_masks_the_prompt(tok):
    a = encode_example(tok, "07-3=", "04,01")
    b = encode_example(tok, "47-5=", task.solve(47, 5), bos=False)
    assert a[0][0] == tok.bos_token_id and a[1] == 6 and b[1] == 5
    assert a[0][-1] == tok.eos_token_id
    ids, attn, labels = collate([a, b], tok.pad_token_id)
    assert ids.shape == attn.shape == labels.shape == (2, len(b[0]))
    assert attn[0].sum() == len(a[0]) and attn[1].sum() == len(b[0])
    assert (labels[0, :6] == -100).all() and (labels[0, len(a[0]) :] == -100).all()
    assert tok.decode(labels[0, 6 : len(a[0])].tolist()) == "04,01<eos>"
    assert (labels[1, 5:] == ids[1, 5:]).all()


def test_sampler_with_kv_cache_matches_full_recompute(model, tok):
    prompts = [encode_example(tok, p, None)[0] for p in ("47-5=", "09-3=", "99-1=")]
    res = sample_batch(model, tok, prompts, max_new_tokens=12, temperature=0.0)
    for p, out, done in zip(prompts, res.token_ids, res.finished):
        # greedy decoding without a cache, one full forward per token
        seq = list(p)
        with torch.no_grad():
            for _ in range(len(out)):
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(p) :] == out
        assert done == (out[-1] == tok.eos_token_id)
        assert len(out) <= 12
    with pytest.raises(ValueError, match="same length"):
        sample_batch(model, tok, [[1, 2], [1]], 3)


def test_sampling_at_temperature_one_follows_the_distribution(model, tok):
    prompt = encode_example(tok, "47-5=", None)[0]
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
    gen = torch.Generator().manual_seed(0)
    res = sample_batch(model, tok, [prompt] * 4000, max_new_tokens=1, temperature=1.0, generator=gen)
    freq = torch.bincount(torch.tensor([t[0] for t in res.token_ids]), minlength=len(probs)).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_evaluate_agrees_with_per_row_greedy_decoding(model, tok):
    rows = [{"prompt": p, "label": a, "metadata": m} for p, a, m in (task.make_problem_with_meta(random.Random(i)) for i in range(8))]
    res = evaluate(model, tok, rows, temperature=0.0, batch_size=3)
    assert res["num"] == 8
    expected = []
    for r in rows:
        out = sample_batch(model, tok, [encode_example(tok, r["prompt"], None)[0]], max_new_tokens=200, temperature=0.0)
        expected.append(task.compute_reward(out.texts[0], r["label"]) if out.finished[0] else 0.0)
    assert res["accuracy"] == sum(expected) / 8


def test_supervised_training_lowers_the_loss(model, tok):
    cfg = WarmStartConfig(batch_size=16, lr=3e-3, warmup_steps=2, max_steps=40, max_seconds=60, pool_batches=2, cap=8)
    before = _teacher_loss(model, tok)
    hist = train_warm_start(model, tok, cfg)
    after = _teacher_loss(model, tok)
    assert hist["steps"] == 40
    assert after < before - 0.5, (before, after)


def _teacher_loss(model, tok):
    from slime.tasks.warm_start import token_mean_nll

    rng = random.Random(99)
    batch = []
    for _ in range(32):
        p, a = task.make_problem(rng, cap=8)
        batch.append(encode_example(tok, p, a))
    with torch.no_grad():
        return float(token_mean_nll(model, *collate(batch, tok.pad_token_id)))


def test_prepare_cli_caches_on_settings(tmp_path):
    out = tmp_path / "tiny"
    argv = ["--out", str(out), "--train-size", "40", "--eval-size", "8", "--sft-steps", "3", "--hidden-size", "32", "--num-layers", "1"]
    first = prepare_tiny_task.prepare(prepare_tiny_task.parse_cli(argv))
    assert first["cached"] is False and first["sft_steps"] == 3
    assert 0.0 <= first["eval_accuracy_t1"] <= 1.0
    summary = json.loads((out / "model-sft" / "warm_start.json").read_text())
    assert summary["num_params"] == first["num_params"]
    assert len((out / "train.jsonl").read_text().splitlines()) == 40
    eval_rows = task.read_dataset(str(out / "eval.jsonl"))
    assert len(eval_rows) == 8 and all(r["label"] == task.solve(*task.parse_prompt(r["prompt"])) for r in eval_rows)
    weights = out / "model-sft" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    again = prepare_tiny_task.prepare(prepare_tiny_task.parse_cli(argv))
    assert again["cached"] is True and weights.stat().st_mtime_ns == mtime

    changed = prepare_tiny_task.prepare(prepare_tiny_task.parse_cli(argv[:-6] + ["--sft-steps", "4", "--hidden-size", "32", "--num-layers", "1"]))
    assert changed["cached"] is False and changed["sft_steps"] == 4

    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(str(out / "model-sft"))
    t = AutoTokenizer.from_pretrained(str(out / "model-sft"))
    assert m.config.hidden_size == 32 and t.apply_chat_template([{"role": "user", "content": "12-3="}], tokenize=False) == "<bos>12-3="
