"""The cost model's host terms, fitted from the embedded engine's own counters.

A step on the embedded engine: the scheduler thread plans it and issues its work (`decode_launch_s`: on a GPU the
kernels are queued, on a CPU they run as they are issued), waits until its tokens are back on the host, then
appends them, checks stop conditions and finishes rows (`decode_tail_s`). So a step costs

    max(issue, device) + tail

where the device's part is the cost model's linear decode (and prefill) terms. The calibration fits, over every
decode-only probe run (sums over its steps):

- the tail on [steps, rows] from `decode_tail_s`: `host_tail_s`, `host_tail_per_row_s`;
- the issue on [steps, rows, buckets beyond one] from `decode_launch_s`: `host_step_s`, `host_per_row_s`,
  `host_per_bucket_s`;
- the device terms on what is left: the step time less its tail (`device_targets`).

On a CPU issuing is computing, so issue ~ device and the max changes nothing (the tail still leaves the device
terms). On a GPU a step without CUDA graphs is launch-bound at small batches (the issue is the floor that a
linear device fit dips under: a step at 1 row can take longer than at 64); with them the device's time is. An engine that does not count these (SGLang) gets no host terms.
"""

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
