"""Tool calls in a model's text, and the environment that answers them (docs/multi-turn.md).

A call is `<call_open> BODY <call_close>`, BODY `plain` or `json`; the answer is appended as observation tokens
(loss mask 0). A badly written call gets `bad_call_output`; a tool that fails fails the sample."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

BODY_KINDS = ("plain", "json")


@dataclass(frozen=True)
class ToolCallFormat:
    call_open: str
    call_close: str
    body: str = "plain"
    result_open: str = ""
    result_close: str = ""

    def __post_init__(self) -> None:
        if not self.call_open or not self.call_close:
            raise ValueError("ToolCallFormat: call_open and call_close must be non-empty strings")
        if self.body not in BODY_KINDS:
            raise ValueError(f"ToolCallFormat: body must be one of {BODY_KINDS}, got {self.body!r}")

    def format_call(self, name: str, arguments: Any) -> str:
        """The text a model writes to call `name` (what a warm-start teacher imitates)."""
        if self.body == "plain":
            return f"{self.call_open}{arguments}{self.call_close}"
        return f"{self.call_open}{json.dumps({'name': name, 'arguments': arguments})}{self.call_close}"

    def format_result(self, output: str) -> str:
        """The observation text appended after a call (tokenised and appended with loss mask 0)."""
        return f"{self.result_open}{output}{self.result_close}"


@dataclass(frozen=True)
class ToolCall:
    """A call read from a model turn: `error` is set when the model wrote it badly (name/arguments unusable)."""

    name: str | None
    arguments: Any
    text: str  # the call as the model wrote it, markers included
    error: str | None = None


@dataclass(frozen=True)
class ToolSpec:
    """One tool: `function` is the dotted path of `def f(arguments) -> str`, run in a tool worker. Only a
    `safe_to_rerun` call is run again when its result was lost; any other fails its sample."""

    name: str
    function: str
    safe_to_rerun: bool = False
    timeout_s: float | None = None  # None: --tool-timeout

    def __post_init__(self) -> None:
        if not self.name or "." not in self.function:
            raise ValueError(f"ToolSpec {self.name!r}: needs a name and a dotted function path, got {self.function!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"ToolSpec {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class AgentEnv:
    """What `--agent-env` names: the tools, the call format and what a badly written call gets back."""

    tools: tuple[ToolSpec, ...]
    call_format: ToolCallFormat
    bad_call_output: str = "error: {error}"  # `{error}` is replaced by what was wrong with the call
    description: str = ""
    _by_name: dict[str, ToolSpec] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tools:
            raise ValueError("AgentEnv: needs at least one tool")
        by_name = {t.name: t for t in self.tools}
        if len(by_name) != len(self.tools):
            raise ValueError(f"AgentEnv: duplicate tool names in {[t.name for t in self.tools]}")
        if self.call_format.body == "plain" and len(self.tools) != 1:
            raise ValueError("AgentEnv: a plain call body names no tool, so the environment must have exactly one "
                             f"(it has {len(self.tools)}); use body='json'")
        object.__setattr__(self, "_by_name", by_name)

    def tool(self, name: str) -> ToolSpec | None:
        return self._by_name.get(name)

    def parse_call(self, turn_text: str) -> ToolCall | None:
        """The call that ends `turn_text`, or None when the turn does not end with `call_close` (an answer)."""
        fmt = self.call_format
        if not turn_text.endswith(fmt.call_close):
            return None
        head = turn_text[: -len(fmt.call_close)]
        start = head.rfind(fmt.call_open)
        if start < 0:
            return ToolCall(None, None, fmt.call_close, error=f"{fmt.call_close!r} without {fmt.call_open!r}")
        body = head[start + len(fmt.call_open):]
        text = turn_text[start:]
        if fmt.body == "plain":
            return ToolCall(self.tools[0].name, body, text)
        try:
            obj = json.loads(body)
        except ValueError as e:
            return ToolCall(None, None, text, error=f"the call is not JSON ({e})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall(None, None, text, error='the call needs {"name": ..., "arguments": ...}')
        if self.tool(obj["name"]) is None:
            return ToolCall(obj["name"], obj.get("arguments"), text,
                            error=f"no tool named {obj['name']!r} (tools: {', '.join(self._by_name)})")
        return ToolCall(obj["name"], obj.get("arguments", {}), text)

    def bad_call_text(self, error: str) -> str:
        return self.bad_call_output.replace("{error}", error)


# Qwen / Hermes-style calls in ChatML: the observation comes back as a user turn holding <tool_response>.
QWEN_FORMAT = ToolCallFormat(
    call_open="<tool_call>", call_close="</tool_call>", body="json",
    result_open="<|im_end|>\n<|im_start|>user\n<tool_response>\n",
    result_close="\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
)
