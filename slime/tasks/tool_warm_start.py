"""Warm start and in-process evaluation of the agentic `subtract_tool` task: supervised training on teacher
trajectories with observations out of the loss, and a plain-PyTorch multi-turn sampler to measure it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from slime.tasks import subtract_tool as task
from slime.tasks.warm_start import WarmStartConfig, bucketed_batches, decode, encode_example


@dataclass(frozen=True)
class ToolWarmStartConfig(WarmStartConfig):
    cap: int = 24  # a call costs 8 tokens where a number costs 2: shorter chains keep trajectories on CPU scale
    teacher_p: float = 0.3  # error rate of a number the teacher writes itself
    p_call: float = 0.3  # share of steps on which the teacher calls the calculator
    max_steps: int = 600


def encode_trajectory(tokenizer, prompt: str, segments: list[tuple[str, bool]], bos: bool = True):
    """(ids, n_prompt, response loss mask): [BOS] prompt, the segments, EOS; observation tokens masked 0."""
    ids, n_prompt = encode_example(tokenizer, prompt, None, bos)
    mask: list[int] = []
    for text, is_obs in segments:
        seg = tokenizer.encode(text, add_special_tokens=False)
        ids += seg
        mask += [0 if is_obs else 1] * len(seg)
    ids.append(tokenizer.eos_token_id)
    mask.append(1)
    return ids, n_prompt, mask


def teacher_batches(cfg: ToolWarmStartConfig, tokenizer, rng: random.Random):
    """Endless `collate` batches of teacher trajectories, bucketed by length."""
    def example(rng):
        prompt, _ = task.chain.make_problem(rng, cfg.cap, cfg.alpha)
        segments = task.tool_teacher(prompt, rng, cfg.p_call, cfg.teacher_p)
        return encode_trajectory(tokenizer, prompt, segments, bos=rng.random() >= cfg.no_bos_fraction)

    return bucketed_batches(cfg, rng, example)


@dataclass
class ToolSampleResult:
    texts: list[str]
    token_ids: list[list[int]]
    observation: list[list[bool]]  # per response token: appended by the calculator (not sampled)
    finished: list[bool]
    calls: list[int] = field(default_factory=list)


def sample_with_tools(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                      generator=None) -> ToolSampleResult:
    """Batched multi-turn sampling (equal-length prompts): at each ``]`` the calculator answers in-process and
    its tokens are fed in before the model samples again. `max_new_tokens` counts every response token."""
    eos = tokenizer.eos_token_id
    close_id = tokenizer.convert_tokens_to_ids(task.CALL_FORMAT.call_close)
    bsz = len(prompt_ids)
    out: list[list[int]] = [[] for _ in range(bsz)]
    obs: list[list[bool]] = [[] for _ in range(bsz)]
    forced: list[list[int]] = [[] for _ in range(bsz)]
    calls = [0] * bsz
    finished = [False] * bsz

    def step(nxt: list[int]) -> list[int] | None:
        for i in range(bsz):
            if finished[i]:
                continue
            obs[i].append(bool(forced[i]))
            if forced[i]:
                nxt[i] = forced[i].pop(0)
            out[i].append(nxt[i])
            if obs[i][-1]:
                continue
            if nxt[i] == eos:
                finished[i] = True
            elif nxt[i] == close_id:
                call = task.ENV.parse_call(tokenizer.decode(out[i]))
                answer = task.ENV.bad_call_text(call.error) if call.error else task.calculator(call.arguments)
                forced[i] = tokenizer.encode(task.CALL_FORMAT.format_result(answer), add_special_tokens=False)
                calls[i] += 1
        return None if all(finished) else nxt

    decode(model, prompt_ids, max_new_tokens, temperature, generator, step)
    texts = [tokenizer.decode([t for t in toks if t != eos]) for toks in out]
    return ToolSampleResult(texts=texts, token_ids=out, observation=obs, finished=finished, calls=calls)


def evaluate_with_tools(model, tokenizer, rows: list[dict], temperature: float = 1.0, batch_size: int = 128,
                        seed: int = 0) -> dict:
    """Accuracy on `rows`, calls per sample, and the share of chain steps that were calls."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["label"]))
    correct, calls, steps = [0.0] * len(rows), [0] * len(rows), [0] * len(rows)
    model.eval()
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        prompts = [encode_example(tokenizer, rows[i]["prompt"], None)[0] for i in idx]
        n_label = max(len(rows[i]["label"]) for i in idx)
        max_new = 3 * n_label + 8  # every number called: 8 tokens per 3 of the label
        res = sample_with_tools(model, tokenizer, prompts, max_new, temperature, gen)
        for j, i in enumerate(idx):
            correct[i] = task.compute_reward(res.texts[j], rows[i]["label"]) if res.finished[j] else 0.0
            calls[i] = res.calls[j]
            steps[i] = task.count_steps(res.texts[j])
    n = max(1, len(rows))
    return {
        "accuracy": sum(correct) / n,
        "calls_per_sample": sum(calls) / n,
        "call_share": sum(calls) / max(1, sum(steps)),
        "num": len(rows),
    }
