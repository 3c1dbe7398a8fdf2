"""Plugins used by end-to-end tests (loaded by dotted path, as users' plugins are)."""


async def parity_reward(args, sample) -> float:
    """A reward with spread within every group, so advantages are nonzero even for an untrained model."""
    return float(sample.response_length % 2)
