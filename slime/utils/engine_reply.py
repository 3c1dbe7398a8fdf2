"""What an engine's `/generate` reply says about its tokens, read where a `Sample` grows (the requester's
segments, `Sample.append_response_tokens` for plugins): the policy version of each output token."""

from __future__ import annotations


class GenerateResponseError(RuntimeError):
    """An engine reply that breaks the SGLang /generate contract; the message names the field."""


def token_versions(meta: dict, n: int, where: str) -> list[int] | None:
    """The weight version of each of a reply's `n` tokens, or None when they are not ints."""
    spans = meta.get("weight_versions")
    if spans is None:
        try:
            return [int(meta.get("weight_version"))] * n
        except (TypeError, ValueError):
            return None
    if not isinstance(spans, list) or not spans:
        raise GenerateResponseError(f"{where}: meta_info.weight_versions must be a non-empty list, got {spans!r}")
    versions: list[int] = []
    for k, span in enumerate(spans):
        ok = isinstance(span, dict) and all(isinstance(span.get(f), int) for f in ("start", "end"))
        if not ok or span["start"] != len(versions) or span["end"] < span["start"]:
            raise GenerateResponseError(f"{where}: meta_info.weight_versions[{k}] = {span!r} does not continue "
                                        f"the spans at output token {len(versions)}")
        try:
            version = int(span.get("version"))
        except (TypeError, ValueError):
            return None
        versions += [version] * (span["end"] - span["start"])
    if len(versions) != n:
        raise GenerateResponseError(f"{where}: meta_info.weight_versions cover {len(versions)} tokens, the reply has {n}")
    return versions
