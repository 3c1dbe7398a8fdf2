"""Weight updates: how the trainer's weights reach the engines, how often, and what the requests in flight do
meanwhile (--pause-mode, --reuse-stale-kv)."""

from __future__ import annotations

import argparse

from slime.arguments.base import Args, _require

UPDATE_WEIGHT_MODES = ("tensor", "distributed", "disk")
PAUSE_MODES = ("abort", "retract", "in_place")
# train_async.py's default --pause-mode, chosen by measurement (benchmarks/README.md, its `--pause-mode` row)
ASYNC_PAUSE_MODE = "in_place"


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("weight updates")
    g.add_argument("--update-weight-buffer-size", type=int, default=512 * 1024**2, help="bytes per weight-sync bucket")
    g.add_argument("--update-weight-mode", type=_update_weight_mode, default=None,
                   help="how weights reach the engines: tensor (CUDA IPC handles / shared memory to the engine on the "
                        "same devices; needs --colocate), distributed (a broadcast group) or disk (a saved directory); "
                        "default: tensor with --colocate, else distributed")
    g.add_argument("--update-weights-from-disk", action="store_true",
                   help="slime's flag: the same as --update-weight-mode disk")
    g.add_argument("--update-weights-interval", type=int, default=1,
                   help="push the trainer's weights to the engines every N steps: train_async.py (in flight); "
                        "train.py takes only 1 (it pushes after every step)")
    g.add_argument("--reuse-stale-kv", action="store_true",
                   help="weight updates keep the engines' cache (flush_cache=false), so a parked sample resumes on "
                        "the KV its earlier tokens had (computed by older weights) instead of being re-prefilled; "
                        "its tokens keep their versions and go through the same off-policy correction")
    g.add_argument("--pause-mode", choices=PAUSE_MODES, default=ASYNC_PAUSE_MODE if entry == "train_async.py" else "abort",
                   help="train_async.py: how a weight update reaches the requests in flight (SGLang's /pause_generation "
                        "modes). abort: they are aborted, wait, and resume from their tokens under the new version "
                        "(re-prefilled); retract: the engines keep them, free their KV and prefill them again after the "
                        "update; in_place: the engines keep them with their KV and go on (nothing re-prefilled; tokens "
                        "sampled after the update attend to KV of older weights, are labelled with the version that "
                        "sampled them and corrected by TIS; the update keeps the cache, flush_cache=false). Every token "
                        f"keeps its version and --max-staleness holds in each mode. Default: {ASYNC_PAUSE_MODE} with "
                        "train_async.py (benchmarks/README.md: chosen by measurement), abort with train.py (its updates "
                        "find the engines idle: nothing in flight to pause)")


def _update_weight_mode(value: str) -> str:
    if value in UPDATE_WEIGHT_MODES:
        return value
    if value in ("full", "delta"):  # upstream slime's values (with --update-weight-transport nccl | disk)
        raise argparse.ArgumentTypeError(
            f"{value!r} is upstream slime's; here the mode is the transport: tensor (colocated), distributed (upstream's "
            "full with --update-weight-transport nccl) or disk (full with disk); delta is not supported")
    raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(UPDATE_WEIGHT_MODES)}")


def fill_defaults(a: Args) -> None:
    if a.update_weight_mode is None:
        a.update_weight_mode = "disk" if a.update_weights_from_disk else ("tensor" if a.colocate else "distributed")


def check(a: Args, entry: str) -> None:
    _require(not a.update_weights_from_disk or a.update_weight_mode == "disk", "--update-weights-from-disk",
             f"contradicts --update-weight-mode {a.update_weight_mode}")
    _require(not (a.colocate and a.reuse_stale_kv), "--reuse-stale-kv",
             "contradicts --colocate: colocated engines release their KV cache while the trainer trains")
    _require(a.update_weight_mode != "tensor" or a.colocate, "--update-weight-mode tensor",
             "needs --colocate (tensors are handed over on the devices trainer and engines share)")
    _require(a.update_weight_buffer_size > 0, "--update-weight-buffer-size", "must be > 0")
    _require(a.update_weights_interval >= 1, "--update-weights-interval", "must be >= 1")
    _require(entry == "train_async.py" or a.update_weights_interval == 1, "--update-weights-interval",
             f"{a.update_weights_interval} is train_async.py's (engines that run behind the trainer); train.py pushes "
             "the new weights after every step (so does upstream's train.py, which never reads this flag), and with "
             "--colocate the engines drop their weights while the trainer trains, so they must get them back each step")
    _require(a.pause_mode == "abort" or entry == "train_async.py", f"--pause-mode {a.pause_mode}",
             "train.py updates the weights of idle engines (each step ends by aborting and parking what is in flight), "
             "so there is nothing to pause; requests run across updates in train_async.py")
