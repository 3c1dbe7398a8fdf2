"""The one `Sample` that flows from a dataset row to the loss.

Invariant: `loss_mask`, `rollout_log_probs` and `weight_versions` have exactly `response_length` entries and
`tokens` is prompt + response (`append_response` keeps them in step). Upstream's plugin API keeps its meaning."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from types import MappingProxyType
from typing import Any

from slime.utils.engine_reply import token_versions
from slime.utils.upstream_fields import UNSUPPORTED_FIELDS

# the version of a token whose producer is not known yet (`complete_response` fills it in)
UNKNOWN_VERSION = -1


class SampleInvariantError(ValueError):
    """Raised when an operation would break the per-token length invariant."""


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        """Finished samples are final: they are rewarded and never resumed."""
        return self in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)


@dataclass
class Sample:
    # identity
    index: int | None = None  # unique sample id within the run
    group_index: int | None = None  # prompt-group id: all n samples of a prompt share it
    # prompt side
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)  # prompt ids + response ids
    # response side
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)  # behaviour log-probs
    weight_versions: list[int] = field(default_factory=list)  # policy version of each response token
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    # upstream slime's switches for plugins, with upstream's meaning: samples sharing a `rollout_id` are one
    # rollout in the loss; a `remove_sample` is rewarded but stays out of the loss
    rollout_id: int | None = None
    remove_sample: bool = False
    # upstream's fan-out: more finished samples a list-returning generate made of this one (`expand_fanout`)
    fanout: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.status = Status(self.status)
        self.check()

    # ---- invariants -------------------------------------------------------
    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def check(self) -> None:
        """Raise `SampleInvariantError` unless every per-token field lines up."""
        n = self.response_length
        if n < 0 or n > len(self.tokens):
            raise SampleInvariantError(
                f"sample {self.index}: response_length={n} but only {len(self.tokens)} tokens"
            )
        for name in ("loss_mask", "rollout_log_probs", "weight_versions"):
            got = len(getattr(self, name))
            if got != n:
                raise SampleInvariantError(
                    f"sample {self.index}: {name} has {got} entries, response_length is {n}"
                )

    # ---- growth -----------------------------------------------------------
    def append_response(
        self,
        token_ids: list[int],
        log_probs: list[float],
        weight_version: int | list[int],
        text: str = "",
        loss_mask: list[int] | None = None,
    ) -> None:
        """Append one generated segment (`weight_version`: one int or one per token); every per-token field grows."""
        k = len(token_ids)
        versions = [int(weight_version)] * k if isinstance(weight_version, int) else list(weight_version)
        mask = [1] * k if loss_mask is None else list(loss_mask)
        if len(log_probs) != k or len(versions) != k or len(mask) != k:
            raise SampleInvariantError(
                f"sample {self.index}: segment of {k} tokens came with {len(log_probs)} log-probs, "
                f"{len(versions)} versions and {len(mask)} loss-mask entries"
            )
        self.tokens.extend(int(t) for t in token_ids)
        self.rollout_log_probs.extend(float(x) for x in log_probs)
        self.weight_versions.extend(versions)
        self.loss_mask.extend(int(m) for m in mask)
        self.response_length += k
        self.response += text

    def append_response_tokens(self, args=None, *, tokens=None, log_probs=None, trainable: bool = True,
                               meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """Upstream slime's way for a plugin to grow the response: model tokens (`trainable`, with log-probs and
        `meta_info`) or tool tokens (loss mask 0); `update_terminal_info` sets the status. `args` is not read."""
        ids = [int(t) for t in (tokens.reshape(-1).tolist() if hasattr(tokens, "reshape") else tokens or [])]
        if log_probs is not None:
            log_probs = [float(x) for x in (log_probs.reshape(-1).tolist() if hasattr(log_probs, "reshape") else log_probs)]
            if len(log_probs) != len(ids):
                raise SampleInvariantError(f"sample {self.index}: {len(log_probs)} log_probs for {len(ids)} tokens")
        if ids and trainable and log_probs is None:
            raise SampleInvariantError(f"sample {self.index}: trainable tokens need their rollout log_probs "
                                       "(request them with \"return_logprob\": true)")
        if ids and not trainable and log_probs is not None:
            raise SampleInvariantError(f"sample {self.index}: non-trainable tokens take no log_probs")
        self._adopt_plugin_fields(trainable and bool(ids))
        meta = meta_info or {}
        if trainable:
            versions = token_versions(meta, len(ids), f"sample {self.index}: meta_info") if meta else None
        else:
            versions = [self.weight_versions[-1] if self.weight_versions else UNKNOWN_VERSION] * len(ids)
        self.append_response(ids, log_probs if trainable else [0.0] * len(ids),
                             versions if versions is not None else UNKNOWN_VERSION, text or "",
                             loss_mask=[1 if trainable else 0] * len(ids))
        finish = meta.get("finish_reason") if update_terminal_info else None
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind in _FINISH_STATUS:
            self.status = _FINISH_STATUS[kind]

    def _adopt_plugin_fields(self, trainable: bool) -> None:
        """Per-token fields a plugin set to None (upstream's empty) or left short, as lists again."""
        n = self.response_length
        if self.loss_mask is None:
            self.loss_mask = [1] * n
        if self.weight_versions is None:
            self.weight_versions = []
        if self.rollout_log_probs is None:
            if trainable and n:
                raise SampleInvariantError(f"sample {self.index}: has {n} response tokens but no rollout_log_probs; "
                                           "trainable tokens cannot follow them")
            self.rollout_log_probs = [0.0] * n
        self.weight_versions = _versions_for(self.weight_versions, n, UNKNOWN_VERSION)
        self.check()

    def adopt_fanout(self, samples: list, weight_version: int, where: str) -> bool:
        """A list-returning custom generate's result (upstream's fan-out): all finished, this sample becomes the
        first and the others join its group; else this sample is ABORTED. Returns whether it finished."""
        if not isinstance(samples, list) or not samples:
            raise TypeError(f"{where}: returned an empty list for sample {self.index}; return the Sample it was "
                            "given (FAILED if nothing came of it), or a list of finished Samples")
        for k, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"{where}: returned a list whose item {k} is a {type(s).__name__}, not a Sample")
            if s.group_index not in (None, self.group_index):
                raise ValueError(f"{where}: sample {s.index} of the list returned for sample {self.index} has "
                                 f"group_index {s.group_index}; a fan-out stays in its group ({self.group_index})")
        if not all(s.status.is_finished for s in samples):
            self.status = Status.ABORTED
            return False
        first = self if any(s is self for s in samples) else samples[0]  # by identity: copies compare equal
        others = [s for s in samples if s is not first]
        if first is not self:  # this object is the one its group holds: it becomes the first of them
            vars(self).clear()
            vars(self).update(vars(first))
        for s in (self, *others):
            s.group_index, s.fanout = self.group_index, []
            s.index = self.index if s.index is None else s.index
            s.complete_response(weight_version, where)
        self.fanout = others
        return True

    def get_reward_value(self, args) -> Any:
        """Upstream's: the reward, or with `--reward-key` the reward dict's field of that name."""
        if not args.reward_key:
            return self.reward
        if not isinstance(self.reward, dict) or args.reward_key not in self.reward:
            raise KeyError(f"sample {self.index}: --reward-key {args.reward_key!r} is not a field of its reward "
                           f"{self.reward!r}")
        return self.reward[args.reward_key]

    @property
    def trained_loss_mask(self) -> list[int]:
        """The loss mask the trainer uses: all 0 for a sample a plugin removed (`remove_sample`)."""
        return [0] * self.response_length if self.remove_sample else self.loss_mask

    @property
    def effective_response_length(self) -> int:
        """Response tokens in the loss (loss mask 1): upstream's."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def complete_response(self, weight_version: int, where: str) -> None:
        """Fill in what a plugin that grew the response itself left out (versions, loss mask); missing log-probs
        and meaningless upstream fields are refused (`where` names the plugin)."""
        self.check_upstream_fields(where)
        n = self.response_length
        if n < 0 or n > len(self.tokens):
            raise SampleInvariantError(f"{where}: sample {self.index} has response_length {n} but {len(self.tokens)} "
                                       "tokens (tokens must be the prompt followed by the response)")
        if self.rollout_log_probs is None and n == 0:
            self.rollout_log_probs = []
        if self.rollout_log_probs is None or len(self.rollout_log_probs) != n:
            got = None if self.rollout_log_probs is None else len(self.rollout_log_probs)
            raise SampleInvariantError(f"{where}: sample {self.index} has {got} rollout_log_probs for {n} response "
                                       "tokens; request them (\"return_logprob\": true) and set one per token: the "
                                       "trainer corrects off-policy tokens against them")
        if self.loss_mask is None:
            self.loss_mask = []
        if self.weight_versions is None:
            self.weight_versions = []
        if len(self.loss_mask) < n:
            self.loss_mask = list(self.loss_mask) + [1] * (n - len(self.loss_mask))
        self.weight_versions = [int(weight_version) if v == UNKNOWN_VERSION else v
                                for v in _versions_for(self.weight_versions, n, UNKNOWN_VERSION)]
        try:
            self.check()
        except SampleInvariantError as e:
            raise SampleInvariantError(f"{where}: {e}") from None

    def check_upstream_fields(self, where: str) -> None:
        """Refuse upstream slime's Sample fields that have no meaning here (`UNSUPPORTED_FIELDS`) when a plugin set
        them to anything but upstream's default, and a `rollout_id` that is not an int."""
        for name, why in UNSUPPORTED_FIELDS.items():
            value = vars(self).get(name)
            if value is not None and not (isinstance(value, Mapping) and not value):
                raise ValueError(f"{where}: sample {self.index} sets {name} (upstream slime's Sample field): {why}; "
                                 "leave it unset")
        if self.rollout_id is not None and (isinstance(self.rollout_id, bool) or not isinstance(self.rollout_id, int)):
            raise TypeError(f"{where}: sample {self.index} has rollout_id {self.rollout_id!r}; upstream's is an int "
                            "shared by the samples of one rollout (or None)")

    def reset_response(self) -> None:
        """Drop the whole response and go back to the bare prompt (staleness restart)."""
        del self.tokens[self.prompt_length :]
        self.response = ""
        self.response_length = 0
        self.loss_mask.clear()
        self.rollout_log_probs.clear()
        self.weight_versions.clear()
        self.reward = None
        self.remove_sample = False  # a verdict on the response dropped
        self.status = Status.PENDING

    def mask_tokens_older_than(self, min_version: int) -> int:
        """Zero the loss mask of response tokens produced before `min_version`; return how many."""
        masked = 0
        for i, v in enumerate(self.weight_versions):
            if v < min_version and self.loss_mask[i]:
                self.loss_mask[i] = 0
                masked += 1
        return masked

    # ---- version accounting -----------------------------------------------
    def version_counts(self, in_loss_only: bool = True) -> Counter:
        """{policy version: response tokens it produced}, over the tokens in the loss by default."""
        if not in_loss_only:
            return Counter(self.weight_versions)
        return Counter(v for v, m in zip(self.weight_versions, self.trained_loss_mask) if m)

    def newest_version(self) -> int | None:
        return max(self.weight_versions) if self.weight_versions else None

    def loss_tokens_older_than(self, min_version: int) -> int:
        """How many response tokens in the loss (`trained_loss_mask` 1) were produced before `min_version`."""
        return sum(1 for v, m in zip(self.weight_versions, self.trained_loss_mask) if m and v < min_version)

    def oldest_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    # ---- serialisation ----------------------------------------------------
    def scalar_reward(self, reward_key: str | None = None) -> float | None:
        """The reward as a number: a dict reward's `reward_key` field (`--reward-key`); None if unset/unusable."""
        r = self.reward
        if isinstance(r, dict):
            r = r.get(reward_key) if reward_key is not None else None
        if r is None or isinstance(r, bool) or not isinstance(r, (int, float)):
            return None
        return float(r)

    def extra(self) -> dict[str, Any]:
        """Attributes a plugin set that are not fields (upstream plugins keep their own state on samples)."""
        return {k: v for k, v in vars(self).items() if k not in _FIELD_NAMES}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        d["fanout"] = [s.to_dict() for s in self.fanout]
        extra = self.extra()
        if extra:
            d["extra"] = copy.deepcopy(extra)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        d = copy.deepcopy(d)
        extra = d.pop("extra", None) or {}
        unknown = set(d) - _FIELD_NAMES
        if unknown:
            raise ValueError(f"Sample.from_dict: unknown keys {sorted(unknown)}")
        d["fanout"] = [cls.from_dict(x) for x in d.get("fanout", [])]
        sample = cls(**d)
        for k, v in extra.items():
            setattr(sample, k, v)
        return sample


def expand_fanout(group: list[Sample]) -> list[Sample]:
    """`group` (in place, and returned) with each sample's fan-out (`Sample.adopt_fanout`) right after it."""
    if any(s.fanout for s in group):
        group[:] = [x for s in group for x in (s, *s.fanout)]
        for s in group:
            s.fanout = []
    return group


def _versions_for(versions: list[int], n: int, missing: int) -> list[int]:
    """One version per response token: a plugin that dropped tokens by setting `response_length` (upstream keeps
    versions per request, so its plugins never trim them) keeps those of the first `n`; missing ones are `missing`."""
    return list(versions[:n]) + [missing] * (n - len(versions))


_FIELD_NAMES = frozenset(f.name for f in fields(Sample))
for _name in UNSUPPORTED_FIELDS:  # class-level defaults: what upstream's plugins read (`if sample.multimodal_inputs:`)
    setattr(Sample, _name, MappingProxyType({}) if _name == "apply_chat_template_kwargs" else None)
Sample.session_id = None  # upstream's routing key for its own generate's requests; a plugin sets it for its own
Sample.non_generation_time = 0.0  # seconds a plugin spent outside generation (tools): `rollout/non_generation_time_*`
_FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
Sample.Status = Status  # upstream slime's spelling (`Sample.Status.COMPLETED`), for plugins written against it
