"""Supervised warm start of a tiny Qwen3 on the `subtract_chain` noisy teacher, plus a fast sampler for evaluation.
It plateaus near the teacher's accuracy, leaving headroom for RL; one CPU thread."""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field

from slime.tasks import subtract_chain as task

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStartConfig:
    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    batch_size: int = 64
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_steps: int = 800
    max_seconds: float = 900.0  # a safety cap; steps are the budget (contention inflates wall time)
    teacher_p: float = 0.1
    cap: int = 64
    alpha: float = 1.0
    pool_batches: int = 16  # problems are drawn in pools of pool_batches*batch_size and bucketed by length
    no_bos_fraction: float = 0.1  # some prompts without BOS, so a run without --apply-chat-template still works
    threads: int = 1

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass
class SampleResult:
    texts: list[str]
    lengths: list[int]
    finished: list[bool]
    token_ids: list[list[int]] = field(default_factory=list)


def encode_example(tokenizer, prompt: str, response: str | None, bos: bool = True) -> tuple[list[int], int]:
    """Token ids of [BOS] prompt [response EOS] and the prompt length (BOS included)."""
    ids = ([tokenizer.bos_token_id] if bos else []) + tokenizer.encode(prompt, add_special_tokens=False)
    n_prompt = len(ids)
    if response is not None:
        ids = ids + tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    return ids, n_prompt


def bucketed_batches(cfg: WarmStartConfig, rng: random.Random, example):
    """Endless batches of `example(rng)`, drawn in pools and bucketed by length to cut padding."""
    while True:
        pool = [example(rng) for _ in range(cfg.pool_batches * cfg.batch_size)]
        pool.sort(key=lambda x: len(x[0]))
        batches = [pool[i : i + cfg.batch_size] for i in range(0, len(pool), cfg.batch_size)]
        rng.shuffle(batches)
        yield from batches


def collate(batch, pad_id: int):
    """Right-padded ids, attention mask and labels (-100 outside the response and where `response_mask` is 0)."""
    import torch

    width = max(len(ex[0]) for ex in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for i, (ids, n_prompt, *mask) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = 1
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        if mask:
            keep = torch.tensor(mask[0], dtype=torch.bool)
            labels[i, n_prompt : len(ids)][~keep] = -100
    return input_ids, attn, labels


def token_mean_nll(model, input_ids, attn, labels):
    import torch.nn.functional as F

    logits = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1]
    tgt = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tgt.reshape(-1), ignore_index=-100)


def pick_next(logits, temperature: float, generator=None):
    """One token per row of [rows, vocab] logits: greedy at temperature 0, else sampled from the softmax."""
    import torch

    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator).squeeze(-1)


def decode(model, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, generator, step) -> None:
    """Batched KV-cached decoding of equal-length prompts; `step(sampled)` returns what to feed back, or None."""
    import torch
    from transformers import DynamicCache

    if len({len(p) for p in prompt_ids}) != 1:
        raise ValueError("all prompts must have the same length (no padding is used)")
    cache, x = DynamicCache(), torch.tensor(prompt_ids, dtype=torch.long)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[:, -1].float()
            fed = step(pick_next(logits, temperature, generator).tolist())
            if fed is None:
                return
            x = torch.tensor(fed, dtype=torch.long).unsqueeze(-1)


def sample_batch(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, generator=None) -> SampleResult:
    """Batched sampling of equal-length prompts until EOS (`decode`)."""
    eos = tokenizer.eos_token_id
    out_tokens: list[list[int]] = [[] for _ in prompt_ids]
    finished = [False] * len(prompt_ids)

    def step(nxt: list[int]) -> list[int] | None:
        for i, t in enumerate(nxt):
            if not finished[i]:
                out_tokens[i].append(t)
                finished[i] = t == eos
        return None if all(finished) else nxt

    decode(model, prompt_ids, max_new_tokens, temperature, generator, step)
    texts = [tokenizer.decode([t for t in toks if t != eos]) for toks in out_tokens]
    return SampleResult(texts=texts, lengths=[len(t) for t in out_tokens], finished=finished, token_ids=out_tokens)


def evaluate(model, tokenizer, rows: list[dict], temperature: float = 1.0, batch_size: int = 128, seed: int = 0) -> dict:
    """Exact-match accuracy on `rows`; each batch samples at most its longest label + 1 tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["label"]))
    correct = [0.0] * len(rows)
    model.eval()
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        prompts = [encode_example(tokenizer, rows[i]["prompt"], None)[0] for i in idx]
        max_new = max(len(tokenizer.encode(rows[i]["label"], add_special_tokens=False)) for i in idx) + 1
        res = sample_batch(model, tokenizer, prompts, max_new, temperature, gen)
        for j, i in enumerate(idx):
            correct[i] = task.compute_reward(res.texts[j], rows[i]["label"]) if res.finished[j] else 0.0
    steps = [r.get("metadata", {}).get("steps", len(r["label"]) // 3 + 1) for r in rows]
    long_idx = [i for i, q in enumerate(steps) if q > 24]
    return {
        "accuracy": sum(correct) / len(rows),
        "accuracy_long": (sum(correct[i] for i in long_idx) / len(long_idx)) if long_idx else float("nan"),
        "num": len(rows),
    }


def _lr_at(cfg: WarmStartConfig, step: int, frac_done: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac_done)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def train_warm_start(model, tokenizer, cfg: WarmStartConfig, eval_rows: list[dict] | None = None, eval_every_steps: int = 0, eval_limit: int = 256, batches=None) -> dict:
    """Supervised training on the noisy teacher until `max_steps` or `max_seconds` (a cosine schedule over
    whichever ends first); returns a history, with accuracy at T=1 every `eval_every_steps`."""
    import torch

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    if batches is None:
        def example(rng):
            prompt, _ = task.make_problem(rng, cfg.cap, cfg.alpha)
            resp = task.noisy_teacher(prompt, rng, cfg.teacher_p)
            return encode_example(tokenizer, prompt, resp, bos=rng.random() >= cfg.no_bos_fraction)

        batches = bucketed_batches(cfg, rng, example)
    curve, losses = [], []
    train_s, cpu_s, step = 0.0, 0.0, 0
    model.train()
    while step < cfg.max_steps and train_s < cfg.max_seconds:
        t0, c0 = time.perf_counter(), time.process_time()
        frac = max(step / cfg.max_steps, train_s / cfg.max_seconds)
        for g in opt.param_groups:
            g["lr"] = _lr_at(cfg, step, frac)
        input_ids, attn, labels = collate(next(batches), tokenizer.pad_token_id)
        loss = token_mean_nll(model, input_ids, attn, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        train_s += time.perf_counter() - t0
        cpu_s += time.process_time() - c0
        if eval_rows and eval_every_steps > 0 and step % eval_every_steps == 0:
            acc = evaluate(model, tokenizer, eval_rows[:eval_limit], 1.0, seed=cfg.seed)["accuracy"]
            model.train()
            curve.append({"step": step, "train_s": round(train_s, 1), "cpu_s": round(cpu_s, 1), "loss": sum(losses[-20:]) / len(losses[-20:]), "acc_t1": acc})
            logger.info("warm start step %d, %.0f s: loss %.4f, acc@T1 %.3f", step, train_s, curve[-1]["loss"], acc)
        elif step % 100 == 0:
            logger.info("warm start step %d, %.0f s: loss %.4f", step, train_s, sum(losses[-20:]) / len(losses[-20:]))
    model.eval()
    return {"steps": step, "train_seconds": train_s, "cpu_seconds": cpu_s, "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])), "curve": curve}
