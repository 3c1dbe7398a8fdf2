"""Partial rollout (APRIL): over-sampling, parking what is unfinished, the rollout modes and how many requests a
pool keeps in flight (admission), the filters of groups."""

from __future__ import annotations

import argparse
import os

from slime.arguments.base import Args, _here, _require, make_absolute
from slime.arguments.rollout import BUILTIN_ROLLOUT_FUNCTION


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("partial rollout (APRIL)")
    g.add_argument("--partial-rollout", action="store_true",
                   help="abort unfinished requests once the batch is full and park them in the buffer to resume next step")
    g.add_argument("--over-sampling-batch-size", type=_int_or_auto, default=None,
                   help="groups submitted per chunk: > rollout batch size over-samples; smaller submits chunks until "
                        "the target is met; equal (default) is synchronous; 'auto': each step's size is chosen by the "
                        "rollout simulator from what the last steps showed (response lengths incl. the unfinished "
                        "tail, the dynamic filter's pass rate, --max-staleness), logged as rollout/over_sampling_batch_size")
    g.add_argument("--rollout-cost-model", type=str, default=None,
                   help="engine cost model for --over-sampling-batch-size auto: a JSON from `tools/simulate_rollout.py "
                        "calibrate`, or gpu:<h100|h200|mi300x>:<model>:tp<N> (modelled from datasheets); default: "
                        "calibrate the engines after the first step (a few seconds)")
    g.add_argument("--buffer-filter-path", type=str, default=None, help="order in which parked groups are resumed (default FIFO)")
    g.add_argument("--dynamic-sampling-filter-path", type=str, default=None,
                   help="e.g. slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std")
    g.add_argument("--rollout-mode", choices=["chunked", "pool", "stream"], default="chunked",
                   help="chunked: submit whole chunks of groups; pool: keep --rollout-pool-size requests in flight (CoPRIS); "
                        "stream (train_async.py only): keep --rollout-pool-size requests in flight across steps, the "
                        "trainer takes the next --rollout-batch-size accepted groups as soon as they exist")
    g.add_argument("--rollout-pool-size", type=int, default=None,
                   help="requests in flight in pool and stream modes (default: --sglang-server-concurrency x engines; "
                        "stream with --admission fixed: --rollout-batch-size x --n-samples-per-prompt, at most that); "
                        "with --admission auto, the most it may keep in flight")
    g.add_argument("--admission", choices=["auto", "fixed"], default=None,
                   help="pool and stream modes: fixed keeps --rollout-pool-size requests in flight; auto adjusts them "
                        "from the engines' load reports (/v1/loads: KV usage, queue, retractions; AIMD-like, "
                        "slime/rollout/admission.py) up to --rollout-pool-size. Default: auto, or fixed when "
                        "--rollout-pool-size is given")


def _int_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def check_given(a: Args) -> None:
    """What the user wrote, checked before the defaults fill the gaps."""
    _require(a.over_sampling_batch_size is None or a.rollout_mode == "chunked", "--over-sampling-batch-size",
             f"sizes --rollout-mode chunked's over-sampled chunks; --rollout-mode {a.rollout_mode} keeps "
             "--rollout-pool-size requests in flight instead (drop --over-sampling-batch-size, or set --rollout-pool-size)")
    _require(a.admission != "auto" or a.rollout_mode in ("pool", "stream"), "--admission auto",
             "adjusts the requests a pool keeps in flight (--rollout-mode pool or stream); --rollout-mode chunked "
             "submits --over-sampling-batch-size groups at a time (--over-sampling-batch-size auto sizes them)")


def fill_defaults(a: Args) -> None:
    """After the cluster's (the pool counts the engines)."""
    if a.rollout_cost_model is not None and not a.rollout_cost_model.startswith("gpu:"):
        make_absolute(a, "rollout_cost_model")
    if a.over_sampling_batch_size is None:
        a.over_sampling_batch_size = a.rollout_batch_size
    if a.admission is None:  # a pool size given by hand is kept; otherwise the engines' loads decide
        a.admission = "auto" if a.rollout_mode in ("pool", "stream") and a.rollout_pool_size is None else "fixed"
    if (a.rollout_pool_size is None and a.rollout_mode == "stream" and a.admission == "fixed"
            and a.rollout_batch_size is not None):
        # one batch's requests: the stream refills as groups finish, so more only adds stale, parked work
        a.rollout_pool_size = min(a.rollout_batch_size * a.n_samples_per_prompt, a.sglang_server_concurrency * a.num_engines)
    if a.rollout_pool_size is None:
        a.rollout_pool_size = a.sglang_server_concurrency * a.num_engines


def check(a: Args, entry: str) -> None:
    if a.over_sampling_batch_size == "auto":
        _require(a.custom_generate_function_path is None, "--over-sampling-batch-size",
                 "auto plans with the rollout simulator, which models one request per sample; with "
                 "--custom-generate-function-path / --agent-env give a size")
    else:
        _require(a.over_sampling_batch_size > 0, "--over-sampling-batch-size", "must be > 0 (or auto)")
    if a.rollout_cost_model is not None:
        _require(a.over_sampling_batch_size == "auto", "--rollout-cost-model", "is used by --over-sampling-batch-size auto only")
        _require(a.rollout_cost_model.startswith("gpu:") or _here(a, os.path.isfile(a.rollout_cost_model)),
                 "--rollout-cost-model",
                 f"{a.rollout_cost_model!r} is neither a file nor gpu:<gpu>:<model>:tp<N>")
    _require(a.rollout_pool_size > 0, "--rollout-pool-size", "must be > 0")
    _require(a.rollout_mode != "stream" or entry == "train_async.py", "--rollout-mode stream",
             "keeps requests in flight while the trainer trains, which needs train_async.py")
    _require(a.rollout_mode != "stream" or a.partial_rollout, "--rollout-mode stream",
             "needs --partial-rollout (requests in flight at a checkpoint or an update are parked and resumed)")
    _require(a.rollout_mode != "stream" or a.rollout_function_path == BUILTIN_ROLLOUT_FUNCTION, "--rollout-function-path",
             f"--rollout-mode stream runs the built-in rollout ({BUILTIN_ROLLOUT_FUNCTION}), not {a.rollout_function_path}")
