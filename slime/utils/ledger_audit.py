"""The ledger audit of a saved run (`tools/audit_ledger.py SAVE_DIR`): nothing lost, nothing held twice,
nothing left in flight."""

from __future__ import annotations

import json
import os

from slime.utils import checkpoint as ckpts
from slime.utils.ledger import Ledger, LedgerError


def audit_checkpoint(ckpt_dir: str) -> dict[str, int]:
    """Raise `LedgerError` naming what is wrong; else the ledger's counts (and `data_groups`)."""
    path = os.path.join(ckpt_dir, "buffer", "buffer.json")
    try:
        with open(path) as f:
            buffer = json.load(f)
    except (OSError, ValueError) as e:
        raise LedgerError(f"{path}: cannot read the buffer ({e})") from e
    driver = ckpts.read_driver_state(ckpt_dir)
    ledger = Ledger()
    ledger.load_state_dict(buffer["ledger"])
    parked = [int(g[0]["group_index"]) for g in buffer["parked"]]
    ready = [int(g[0]["group_index"]) for g in buffer["ready"]]
    summary = ledger.check_balanced(parked, ready, idle=True)  # held == ledger, none held twice, none issued
    source = (driver.get("rollout") or {}).get("data_source") or {}
    if "group_counter" in source:
        issued = int(source["group_counter"])
        known = {int(g) for g in buffer["ledger"]["state"]}
        lost = sorted(set(range(issued)) - known)
        unknown = sorted(known - set(range(issued)))
        if lost or unknown:
            raise LedgerError(f"{ckpt_dir}: the data source issued {issued} groups; without a ledger state: "
                              f"{lost[:10]} ({len(lost)}); in the ledger but never issued: {unknown[:10]} "
                              f"({len(unknown)})")
        summary["data_groups"] = issued
    return summary


def audit_save_dir(save_dir: str, step: int | None = None) -> tuple[str, dict[str, int]]:
    """The checkpoint `--load SAVE_DIR [--ckpt-step step]` would resume, audited: (its path, its counts)."""
    ckpt = ckpts.resolve_checkpoint(save_dir, step)
    if ckpt is None:
        raise FileNotFoundError(f"{save_dir}: no checkpoint to audit")
    return ckpt, audit_checkpoint(ckpt)
