"""Which weight version sampled each token: the engine's spans (`meta_info.weight_versions`) checked against our
record of the request (`VersionWindow`), never labelling a token newer than the truth, and the prefix-cache key
that keeps KV of different versions apart."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

MAX_WARNINGS = 20  # per requester: a misconfigured run would otherwise warn on every reply


def cache_key(version: int) -> str:
    """The `/generate` `extra_key` for `version`: prefix caches never reuse KV across keys (older weights)."""
    return f"weights-v{int(version)}"


class VersionLabels:
    """Labels the tokens of each reply (`label_tokens`) and says how often the engine's word was not taken."""

    def __init__(self, where: str):
        self.where = where
        self.warnings = 0

    def label_tokens(self, sample, engine: list[int] | None, spans_sent: bool, sent: int, newest: int,
                     rid: str, span_lag: int = 0) -> list[int] | int:
        """The version of each of a reply's tokens (an int: all), from the engine's versions and our record."""
        if engine is None:  # the engine's versions are not ints (e.g. its default "default"): ours, if one
            if newest != sent:
                raise ValueError(f"{self.where}: the engines changed version ({sent} -> {newest}) during request {rid} "
                                 "and its reply's weight versions are not integers")
            self._warn("engine weight versions are not integers (request %s); tagging its tokens with version %d",
                       rid, sent)
            return sent
        if not spans_sent and newest != sent:  # old SGLang under a pause: where the update fell is unknown
            sample.metadata["versions_unreported"] = sample.metadata.get("versions_unreported", 0) + len(engine)
            return sent
        if all(sent <= v <= newest for v in engine):
            return lag_spans(engine, span_lag)
        sample.metadata["version_disagreements"] = sample.metadata.get("version_disagreements", 0) + 1
        self._warn("request %s (sample %s): the engine says its tokens came from versions %s, but it ran while the "
                   "engines served versions %d..%d; labelling them with the older of the two (is something else "
                   "updating the engines' weights?)", rid, sample.index, sorted(set(engine)), sent, newest)
        return [min(v, newest) for v in engine]

    def _warn(self, msg: str, *args) -> None:
        self.warnings += 1
        if self.warnings <= MAX_WARNINGS:
            logger.warning(msg + ("" if self.warnings < MAX_WARNINGS else " (further warnings of this kind: DEBUG)"),
                           *args)
        else:
            logger.debug(msg, *args)


def lag_spans(versions: list[int], lag: int) -> list[int]:
    """The first `lag` tokens of each newer span labelled with the version before it: SGLang's in_place pause can
    append a token the older weights sampled after the span boundary (tests/test_real_sglang.py)."""
    if lag <= 0:
        return versions
    out = list(versions)
    for i in range(1, len(versions)):
        if versions[i] != versions[i - 1]:
            for j in range(i, min(i + lag, len(versions))):
                out[j] = versions[i - 1]
    return out


def version_check_metrics(samples) -> dict[str, float]:
    """`rollout/version_disagreements` (replies whose spans fell outside our record) and
    `rollout/versions_unreported_tokens` (tokens labelled `sent` for want of spans) over `samples`."""
    return {
        "rollout/version_disagreements": float(sum(s.metadata.get("version_disagreements", 0) for s in samples)),
        "rollout/versions_unreported_tokens": float(sum(s.metadata.get("versions_unreported", 0) for s in samples)),
    }


__all__ = ["VersionLabels", "cache_key", "version_check_metrics"]
