"""One metrics path: wandb (offline unless asked; its files under the run directory, its config redacted) and
`metrics.jsonl` in the run directory."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from typing import Any

from slime.utils.redact import redact_flags

logger = logging.getLogger(__name__)

WANDB_DIRS = {"WANDB_DIR": "", "WANDB_CACHE_DIR": "wandb/cache", "WANDB_CONFIG_DIR": "wandb/config",
              "WANDB_DATA_DIR": "wandb/data", "WANDB_ARTIFACT_DIR": "wandb/artifacts"}
WANDB_STEP = "rollout/step"  # every wandb chart's x-axis (upstream slime's name): the rollout id, -1 before the first step


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


@contextlib.contextmanager
def _env_defaults(values: dict[str, str]):
    added = [k for k in values if k not in os.environ]
    for k in added:
        os.environ[k] = values[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


class MetricsLogger:
    """Owns the wandb run (if any) and the JSONL file; one `log` call per step."""

    def __init__(self, args, run_dir: str):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._wandb_run = None
        if args.use_wandb and args.wandb_mode != "disabled":
            import wandb

            # every wandb file under the run dir, set only while wandb.init starts and never over the user's value
            with _env_defaults({var: os.path.join(run_dir, sub) for var, sub in WANDB_DIRS.items()}):
                self._wandb_run = wandb.init(
                    project=args.wandb_project,
                    group=args.wandb_group,
                    mode=args.wandb_mode,
                    dir=run_dir,
                    config=redact_flags({k: v for k, v in vars(args).items() if not k.startswith("_")}),
                    # --wandb-key (upstream's flag): this run's key; else wandb's own (WANDB_API_KEY, netrc)
                    settings=wandb.Settings(api_key=args.wandb_key) if args.wandb_key else None,
                )
            # wandb's step starts at 0 and never goes back: the eval at step -1 is its 0, rollout step N its N + 1
            self._wandb_run.define_metric(WANDB_STEP)
            self._wandb_run.define_metric("*", step_metric=WANDB_STEP)
            logger.info("wandb run %s (mode=%s)", self._wandb_run.id, args.wandb_mode)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": int(step), **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb_run is not None:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self._wandb_run.log({WANDB_STEP: int(step), **flat}, step=int(step) + 1)

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_jsonl(path: str, key: str, last: int) -> int:
    """Keep only rows whose `key` <= `last` (a resume re-runs the later steps), atomically; returns rows removed."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a line torn by a kill mid-write
                continue
            if isinstance(row, dict) and isinstance(row.get(key), int) and row[key] > last:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return dropped


def truncate_run_logs(run_dir: str, last_step: int) -> None:
    """On resume from step `last_step`: drop the later rows of metrics, rollout trace and eval scores."""
    for name, key in (("metrics.jsonl", "step"), ("rollout_trace.jsonl", "rollout_id"), ("eval_scores.jsonl", "step")):
        n = truncate_jsonl(os.path.join(run_dir, name), key, last_step)
        if n:
            logger.info("resume from step %d: removed %d later row(s) of %s (they are re-run)", last_step, n, name)
