"""The cost model's host terms, fitted from the embedded engine's counters: a step costs max(issue, device) + tail
(`decode_launch_s`, the linear device terms, `decode_tail_s`). Engines that do not count these get none."""

from __future__ import annotations

from slime.rollout.simulator.cost_model import HOST_TERMS, TAIL_TERMS, nnls_fit


def fit_host(runs: list[tuple[float, float, list[float]]]) -> tuple[dict[str, float], float | None]:
    """`runs`: (issue seconds, tail seconds, [steps, rows, keys, positions, extra buckets]) per decode-only probe run.
    Returns the host terms and the issue fit's relative RMS (None without runs)."""
    terms = {k: 0.0 for k in HOST_TERMS + TAIL_TERMS}
    runs = [r for r in runs if r[2][0] > 0]
    if len(runs) < 3:
        return terms, None
    tail, _ = nnls_fit([[x[0], x[1]] for _, _, x in runs], [t for _, t, _ in runs], TAIL_TERMS,
                       weights=[1.0 / max(1e-9, t) for _, t, _ in runs])
    issue, err = nnls_fit([[x[0], x[1], x[4]] for _, _, x in runs], [i for i, _, _ in runs], HOST_TERMS,
                          weights=[1.0 / max(1e-9, i) for i, _, _ in runs])
    terms.update(tail)
    terms.update(issue)
    return terms, err
