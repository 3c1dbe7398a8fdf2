"""The embedded `subtract_chain` task: `"47-5="` asks for `"42,37,32,27,22,17,12,07,02"` then EOS; a local rule a
tiny model learns, with a Pareto-tailed number of steps (the long tail partial rollout is for)."""

from __future__ import annotations

import json
import math
import os
import random
import re

# Single-character words for `slime.utils.tiny_model.build_tokenizer` (BOS/EOS/PAD are added there).
VOCAB: list[str] = [*"0123456789", "-", "=", ","]

MAX_N = 99
MAX_STEP = 9
_PROMPT_RE = re.compile(r"^\s*(?:<bos>)?(\d{2})-(\d)=\s*$")
_TRAILING_SPECIALS = ("<eos>", "<pad>", "</s>", "<|endoftext|>", "<|im_end|>")


def format_prompt(n: int, s: int) -> str:
    if not (0 <= n <= MAX_N and 1 <= s <= MAX_STEP):
        raise ValueError(f"subtract_chain: need 0 <= n <= {MAX_N} and 1 <= s <= {MAX_STEP}, got n={n}, s={s}")
    return f"{n:02d}-{s}="


def parse_prompt(prompt: str) -> tuple[int, int]:
    """(n, s) from a prompt such as ``"47-5="`` (a leading ``<bos>`` is allowed)."""
    m = _PROMPT_RE.match(prompt)
    if not m:
        raise ValueError(f"subtract_chain: prompt {prompt!r} is not of the form 'NN-S=' (e.g. '47-5=')")
    n, s = int(m.group(1)), int(m.group(2))
    if s < 1:
        raise ValueError(f"subtract_chain: prompt {prompt!r} has step 0")
    return n, s


def format_chain(values: list[int]) -> str:
    return ",".join(f"{v:02d}" for v in values)


def solve(n: int, s: int) -> str:
    """The exact answer: n-s, n-2s, ... down to n mod s (empty when n < s)."""
    return format_chain(list(range(n - s, -1, -s)))


def sample_steps(rng: random.Random, cap: int = 64, alpha: float = 1.0) -> int:
    """q = min(cap, ceil(X)), X ~ Pareto(x_m=1, alpha), so q is in [1, cap] with a power-law tail."""
    if cap < 1 or alpha <= 0:
        raise ValueError(f"subtract_chain: need cap >= 1 and alpha > 0, got cap={cap}, alpha={alpha}")
    u = 1.0 - rng.random()  # in (0, 1]
    x = u ** (-1.0 / alpha)
    return max(1, min(cap, math.ceil(x)))


def make_problem_with_meta(rng: random.Random, cap: int = 64, alpha: float = 1.0) -> tuple[str, str, dict]:
    if cap > MAX_N:
        raise ValueError(f"subtract_chain: cap={cap} exceeds {MAX_N} (n must stay two digits)")
    q = sample_steps(rng, cap, alpha)
    s = rng.randint(1, min(MAX_STEP, MAX_N // q))
    r = rng.randint(0, min(s - 1, MAX_N - q * s))  # keep n = q*s + r <= 99
    n = q * s + r
    return format_prompt(n, s), solve(n, s), {"n": n, "s": s, "steps": q}


def make_problem(rng: random.Random, cap: int = 64, alpha: float = 1.0) -> tuple[str, str]:
    """One random problem: (prompt, answer)."""
    prompt, answer, _ = make_problem_with_meta(rng, cap, alpha)
    return prompt, answer


def write_dataset(path: str, num: int, seed: int, cap: int = 64, alpha: float = 1.0) -> None:
    """Write `num` problems as jsonl rows {"prompt", "label", "metadata": {"n", "s", "steps"}}."""
    if num < 1:
        raise ValueError(f"subtract_chain.write_dataset: num must be >= 1, got {num}")
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for _ in range(num):
            prompt, label, meta = make_problem_with_meta(rng, cap, alpha)
            f.write(json.dumps({"prompt": prompt, "label": label, "metadata": meta}) + "\n")
    os.replace(tmp, path)


def read_dataset(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            for key in ("prompt", "label"):
                if key not in row:
                    raise ValueError(f"{path}: row {i} has no field {key!r}")
            rows.append(row)
    return rows


def normalize_response(response: str) -> str:
    """Strip whitespace and trailing end-of-sequence/padding token strings."""
    text = response.strip()
    changed = True
    while changed:
        changed = False
        for tok in _TRAILING_SPECIALS:
            if text.endswith(tok):
                text = text[: -len(tok)].rstrip()
                changed = True
    return text


def compute_reward(response: str, label: str) -> float:
    """1.0 if the response is exactly the chain in `label` (trailing EOS/whitespace tolerated), else 0.0."""
    if response is None or label is None:
        return 0.0
    return 1.0 if normalize_response(response) == normalize_response(label) else 0.0


def noisy_teacher(prompt: str, rng: random.Random, p: float = 0.1) -> str:
    """A teacher that, with probability `p` per step, subtracts s±1 or s±2 and continues from its own value."""
    n, s = parse_prompt(prompt)
    cur, values = n, []
    while cur >= s:
        d = s
        if rng.random() < p:
            d = s + rng.choice([d for d in (-2, -1, 1, 2) if s + d >= 1])
        nxt = cur - d
        if nxt < 0:
            break
        values.append(nxt)
        cur = nxt
    return format_chain(values)
