"""One metrics path: wandb (offline unless asked) and `metrics.jsonl` in the run directory."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

logger = logging.getLogger(__name__)


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


class MetricsLogger:
    """Owns the wandb run (if any) and the JSONL file; one `log` call per step."""

    def __init__(self, args, run_dir: str):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._wandb_run = None
        if args.use_wandb and args.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_DIR", run_dir)
            self._wandb_run = wandb.init(
                project=args.wandb_project,
                group=args.wandb_group,
                mode=args.wandb_mode,
                dir=run_dir,
                config={k: v for k, v in vars(args).items() if not k.startswith("_")},
            )
            logger.info("wandb run %s (mode=%s)", self._wandb_run.id, args.wandb_mode)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": int(step), **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb_run is not None:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self._wandb_run.log(flat, step=int(step))

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
