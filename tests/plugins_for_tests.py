"""Plugins used by end-to-end tests (loaded by dotted path, as users' plugins are)."""


async def parity_reward(args, sample) -> float:
    """A reward with spread within every group, so advantages are nonzero even for an untrained model."""
    return float(sample.response_length % 2)


async def token_id_reward(args, sample) -> float:
    """A reward that almost any two different responses get differently (a hash of their token ids in [0, 1)), so
    a real model's groups have advantages whatever it answers (even cut at the same length)."""
    return (sum((i + 1) * t for i, t in enumerate(sample.tokens[sample.prompt_length:])) % 1009) / 1009


TOOL_TOKEN_TEXT = ","


async def tool_turn_generate(args, sample, sampling_params):
    """--custom-generate-function-path, written to upstream slime's documented contract (`async def
    custom_generate(args, sample, sampling_params) -> Sample`, posting to the router named by args with
    slime.utils.http_utils.post, growing the sample's fields directly): two model turns with one inserted
    'tool' token between them, kept out of the loss (loss mask 0)."""
    from slime.utils.http_utils import post
    from slime.utils.types import Sample

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    budget = sampling_params["max_new_tokens"] - sample.response_length  # upstream passes the whole budget

    async def turn(max_new: int) -> None:
        out = await post(url, {"input_ids": sample.tokens, "return_logprob": True,
                               "sampling_params": {**sampling_params, "max_new_tokens": max_new}})
        pairs = out["meta_info"]["output_token_logprobs"]
        sample.tokens = sample.tokens + [t for _, t, *_ in pairs]
        sample.rollout_log_probs = sample.rollout_log_probs + [lp for lp, *_ in pairs]
        sample.loss_mask = sample.loss_mask + [1] * len(pairs)
        sample.response += out["text"]
        sample.response_length += len(pairs)

    await turn(max(1, budget // 2))
    tool = sample.tokens[-1]  # stands for a tool's answer; any in-vocabulary id does
    sample.tokens = sample.tokens + [tool]
    sample.rollout_log_probs = sample.rollout_log_probs + [0.0]
    sample.loss_mask = sample.loss_mask + [0]
    sample.response += TOOL_TOKEN_TEXT
    sample.response_length += 1
    rest = budget - sample.response_length
    if rest > 0:
        await turn(rest)
    sample.status = Sample.Status.COMPLETED
    return sample


async def returns_nothing_generate(args, sample, sampling_params):
    """Breaks the contract (returns None): the rollout must refuse it with a message naming the flag."""
    return None


async def faulty_subtract_chain(args, sample):
    """The quick-start reward (subtract_chain) with the faults a long run meets, by prompt (metadata n):
    n % 10 == 7: every sample raises (the group has nothing to train on and is dropped);
    n % 10 == 3: the group's first sample blocks inside `async def` past --reward-timeout;
    n % 10 == 5: the group's first sample raises CancelledError."""
    import asyncio
    import time

    from slime.tasks.subtract_chain import compute_reward

    n = sample.metadata["n"]
    first = sample.index % args.n_samples_per_prompt == 0
    if n % 10 == 7:
        raise ZeroDivisionError("division by zero")
    if n % 10 == 3 and first:
        time.sleep(4)
    if n % 10 == 5 and first:
        raise asyncio.CancelledError()
    return compute_reward(sample.response, sample.label)


async def gated_subtract_chain(args, sample):
    """The quick-start reward (subtract_chain), held where a test says: while `<--run-dir>/gate/hold` holds a number V,
    a sample whose newest token has policy version V or later waits (after touching `held-<its version>` beside
    it), so the test acts on the run at a step of its choosing and then lets it go on by raising V or removing the
    file. Run with a --reward-timeout longer than the hold."""
    import asyncio
    import os

    from slime.tasks.subtract_chain import compute_reward

    gate = os.path.join(args.run_dir, "gate")
    version = max(sample.weight_versions, default=-1)

    def held() -> bool:
        try:
            with open(os.path.join(gate, "hold")) as f:
                return int(f.read()) <= version
        except FileNotFoundError:
            return False

    if held():
        open(os.path.join(gate, f"held-{version}"), "w").close()
        while held():
            await asyncio.sleep(0.05)
    return compute_reward(sample.response, sample.label)


async def always_failing_reward(args, sample):
    raise ZeroDivisionError("division by zero")
