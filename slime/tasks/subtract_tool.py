"""The embedded agentic task `subtract_tool`: subtract_chain with a calculator the model may call,
`[47-5]42,37,[37-5]32` -> chain 42,37,32 (the reward is exact match); its teacher calls on `p_call` of the steps."""

from __future__ import annotations

import random
import re

from slime.tasks import subtract_chain as chain
from slime.utils.tool_calls import AgentEnv, ToolCallFormat, ToolSpec

VOCAB: list[str] = [*chain.VOCAB, "[", "]", "?"]
CALL_FORMAT = ToolCallFormat(call_open="[", call_close="]", body="plain")
BAD_CALL = "??"
ENV = AgentEnv(
    tools=(ToolSpec("calculator", "slime.tasks.subtract_tool.calculator", safe_to_rerun=True),),
    call_format=CALL_FORMAT,
    bad_call_output=BAD_CALL,
    description="calculator: '[NN-S]' -> NN - S as two digits ('??' if unreadable or below zero)",
)
_CALL_BODY = re.compile(r"^(\d{1,2})-(\d)$")
_CALL = re.compile(r"\[[^\[\]]*\]")

format_prompt = chain.format_prompt
parse_prompt = chain.parse_prompt
solve = chain.solve
write_dataset = chain.write_dataset
read_dataset = chain.read_dataset


def calculator(arguments) -> str:
    """`"37-5"` -> `"32"`; anything it cannot read, or a result below zero, -> `"??"` (the model sees it)."""
    m = _CALL_BODY.match(arguments) if isinstance(arguments, str) else None
    if m is None:
        return BAD_CALL
    value = int(m.group(1)) - int(m.group(2))
    return f"{value:02d}" if value >= 0 else BAD_CALL


def strip_calls(response: str) -> str:
    """The chain a trajectory wrote: every ``[...]`` call removed, observations kept."""
    return _CALL.sub("", chain.normalize_response(response))


def compute_reward(response: str, label: str) -> float:
    if response is None or label is None:
        return 0.0
    return chain.compute_reward(strip_calls(response), label)


async def reward(args, sample) -> float:
    """`--custom-rm-path slime.tasks.subtract_tool.reward`."""
    return compute_reward(sample.response, sample.label)


def count_calls(response: str) -> int:
    return len(_CALL.findall(response or ""))


def count_steps(response: str) -> int:
    """Numbers in the chain (written or asked of the calculator)."""
    text = strip_calls(response)
    return len(text.split(",")) if text else 0


def tool_teacher(prompt: str, rng: random.Random, p_call: float, p_err: float) -> list[tuple[str, bool]]:
    """The warm start's teacher trajectory as segments (text, is_observation): calls the calculator with
    probability `p_call`, else writes the next number, wrong by 1 or 2 with probability `p_err`."""
    n, s = parse_prompt(prompt)
    segments: list[tuple[str, bool]] = []
    cur, first = n, True
    while cur >= s:
        sep = "" if first else ","
        first = False
        if rng.random() < p_call:
            segments.append((sep + CALL_FORMAT.format_call("calculator", f"{cur:02d}-{s}"), False))
            cur -= s
            segments.append((f"{cur:02d}", True))
            continue
        d = s
        if rng.random() < p_err:
            d = s + rng.choice([k for k in (-2, -1, 1, 2) if s + k >= 1])
        if cur - d < 0:
            if segments and segments[-1][0] == sep:
                segments.pop()
            break
        cur -= d
        segments.append((f"{sep}{cur:02d}", False))
    return segments
