"""Audit a run's ledger from its checkpoint: every issued prompt group has one state, none is lost or held twice.

    python tools/audit_ledger.py SAVE_DIR [--ckpt-step N]

Exit 0 and the ledger's counts when clean; 1 and what is wrong otherwise; 2 when there is nothing to audit.
What is checked: slime/utils/ledger_audit.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from slime.utils.checkpoint import CheckpointLoadError
from slime.utils.ledger import LedgerError
from slime.utils.ledger_audit import audit_save_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("save_dir", help="the run's --save directory")
    p.add_argument("--ckpt-step", type=int, default=None, help="this checkpoint instead of the newest")
    opts = p.parse_args(argv)
    try:
        ckpt, counts = audit_save_dir(opts.save_dir, opts.ckpt_step)
    except (FileNotFoundError, CheckpointLoadError) as e:
        print(f"audit_ledger: {e}", file=sys.stderr)
        return 2
    except LedgerError as e:
        print(f"audit_ledger: NOT clean: {e}", file=sys.stderr)
        return 1
    print(f"ledger audit of {ckpt}: clean; " + json.dumps(counts, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
