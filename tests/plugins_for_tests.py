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
