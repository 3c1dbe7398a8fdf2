"""Keep credentials out of logs and the wandb config: URL passwords and credential-like query parameters, and
the values of flags named like a credential (`--wandb-key`, `--hf-token`; not `--reward-key`)."""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
SECRET_WORDS = {"secret", "secrets", "password", "passwd", "pwd", "credential", "credentials", "apikey", "auth"}
SECRET_PARTS = ("api_key", "access_key", "private_key", "secret_key", "wandb_key", "hf_key", "auth_key")
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]*)@")
_QUERY = re.compile(r"(?P<name>[?&][^=&#\s]*(?:key|token|secret|passw(?:or)?d|auth|sig)[^=&#\s]*=)(?P<value>[^&#\s]*)",
                    re.IGNORECASE)


def redact_url(text: str) -> str:
    """`text` with URL passwords and credential-like query values masked (any URLs inside it)."""
    if not isinstance(text, str) or "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    return _QUERY.sub(lambda m: f"{m['name']}{MASK}", text)


def is_secret_name(name: str) -> bool:
    """A flag / option / field name that holds a credential (`sglang-api-key`, `--hf-token`, `wandb_key`)."""
    norm = name.lower().lstrip("-").replace("-", "_").replace(".", "_")
    words = norm.split("_")
    # "token" only as the last word: hf_token, access_token; not stop_token_ids or max_tokens_per_gpu
    return bool(SECRET_WORDS & set(words)) or words[-1] == "token" or any(part in norm for part in SECRET_PARTS)


def _redact_value(name: str, value: Any) -> Any:
    if value is None or value is False or value is True:
        return value
    if is_secret_name(name) and isinstance(value, str):
        return MASK
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: _redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_value(name, v) for v in value)
    return value


def redact_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """A copy of `flags` (name -> value) safe to log or upload."""
    return {k: _redact_value(k, v) for k, v in flags.items()}


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the values of secret-named options (`--api-key X`, `--token=X`) and URL passwords masked."""
    out: list[str] = []
    hide_next = False
    for tok in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        if tok.startswith("--"):
            name, eq, _ = tok.partition("=")
            if is_secret_name(name):
                if eq:
                    out.append(f"{name}={MASK}")
                else:
                    out.append(tok)
                    hide_next = True
                continue
        out.append(redact_url(tok))
    return out
