"""Plugins used by end-to-end tests (loaded by dotted path, as users' plugins are)."""


async def parity_reward(args, sample) -> float:
    """A reward with spread within every group, so advantages are nonzero even for an untrained model."""
    return float(sample.response_length % 2)


TOOL_TOKEN_TEXT = ","


async def tool_turn_generate(args, sample, sampling_params, ctx):
    """--custom-generate-function-path contract: two model turns with one inserted 'tool' token between them,
    kept out of the loss (loss mask 0). `ctx` is the rollout's SampleRequester (url, session, policy_version)."""
    from slime.backends.sglang_utils import http_client
    from slime.rollout.sampling_request import parse_segment
    from slime.utils.types import Status

    budget = sampling_params["max_new_tokens"]
    first = max(1, budget // 2)
    out = await http_client.generate(ctx.session, ctx.url, {"input_ids": list(sample.tokens), "return_logprob": True,
                                                            "sampling_params": {**sampling_params, "max_new_tokens": first}})
    ids, lps, version, text, _ = parse_segment(out, ctx.url)
    sample.append_response(ids, lps, version, text)
    tool = [sample.tokens[-1]]  # stands for a tool's answer; any in-vocabulary id does
    sample.append_response(tool, [0.0], ctx.policy_version, TOOL_TOKEN_TEXT, loss_mask=[0])
    rest = budget - len(ids) - 1
    if rest > 0:
        out = await http_client.generate(ctx.session, ctx.url, {"input_ids": list(sample.tokens), "return_logprob": True,
                                                                "sampling_params": {**sampling_params, "max_new_tokens": rest}})
        ids, lps, version, text, _ = parse_segment(out, ctx.url)
        sample.append_response(ids, lps, version, text)
    sample.status = Status.COMPLETED
    return sample


async def returns_nothing_generate(args, sample, sampling_params, ctx):
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


async def always_failing_reward(args, sample):
    raise ZeroDivisionError("division by zero")
