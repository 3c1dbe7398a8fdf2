"""The cluster: trainer nodes and devices, the engines' devices, colocation and offload, where servers listen."""

from __future__ import annotations

import argparse

from slime.arguments.base import Args, _require
from slime.utils.net import AUTO, WILDCARDS, interface_addresses, is_ip_address, is_loopback


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--actor-num-nodes", type=int, default=1, help="number of nodes for training actors")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=1,
                   help="training actors per node (one per GPU; on a CPU machine, one process each)")
    g.add_argument("--rollout-num-gpus", type=int, default=None,
                   help="devices for rollout engines (on CPU: engine slots); default 1, or all actor devices with --colocate")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1, help="tensor-parallel size of each engine")
    g.add_argument("--colocate", action="store_true",
                   help="trainers and engines time-share the same devices: one bundle per device holds a trainer rank "
                        "and (a share of) an engine; the engines release their memory while the trainer trains")
    g.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="with --colocate: the trainer's parameters, gradients and optimizer state leave the device "
                        "between training phases (host memory) and come back for the next one (default: on with "
                        "--colocate, as upstream; --no-offload keeps the trainer on the device)")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                   help="upstream's name for --offload (the trainer's state off the GPU while the engines generate)")
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="upstream's: engines release weights and KV cache while the trainer trains, which --colocate "
                        "always does (needs --colocate)")
    g.add_argument("--train-num-threads", type=int, default=1, help="torch threads of each trainer process (CPU)")
    g.add_argument("--listen-host", type=str, default="auto",
                   help="where the run's servers listen (trainer stores and gloo, the weight-update store, the "
                        "engines, the local Ray node; none authenticates), resolved on each node: auto = 127.0.0.1 "
                        "while the Ray cluster is one machine, else each node's own IP as Ray knows it; an interface "
                        "name (eth0) = that interface's address on every node (also GLOO/NCCL_SOCKET_IFNAME); an "
                        "address (127.0.0.1, 0.0.0.0, 10.0.0.5) = as given")


def fill_defaults(a: Args) -> None:
    """--colocate turns on the trainer's offload (as upstream), and gives the engines every trainer device."""
    if a.offload_train is not None:  # upstream's name for --offload
        _require(a.offload in (None, a.offload_train), "--offload-train",
                 "contradicts --offload / --no-offload (upstream's name for the same thing)")
        a.offload = a.offload_train
    if a.offload is None:
        a.offload = a.colocate
    if a.rollout_num_gpus is None:
        a.rollout_num_gpus = a.actor_num_nodes * a.actor_num_gpus_per_node if a.colocate else 1
    a.num_engines = max(1, a.rollout_num_gpus // max(1, a.rollout_num_gpus_per_engine))


def check(a: Args, entry: str) -> None:
    _require(not a.offload or a.colocate, "--offload", "needs --colocate (the engines use the memory it frees)")
    _require(not a.offload_rollout or a.colocate, "--offload-rollout",
             "needs --colocate (engines release their memory for a trainer on the same devices)")
    _require(a.offload_rollout is not False or not a.colocate, "--no-offload-rollout",
             "contradicts --colocate: colocated engines release weights and KV cache while the trainer trains")
    _require(not a.colocate or a.actor_num_nodes == 1, "--colocate",
             "on more than one node is not built yet: engines are placed on every node's trainer bundles, but the "
             "weight handover by tensor (CUDA IPC / shared memory) and the device plan that feeds it are per node")
    _require(not a.colocate or entry != "train_async.py", "--colocate", "train_async.py overlaps rollout and training, "
             "so engines and trainers need their own devices; use train.py for colocated runs")
    _require(a.rollout_num_gpus_per_engine > 0, "--rollout-num-gpus-per-engine", "must be > 0")
    _require(a.rollout_num_gpus % a.rollout_num_gpus_per_engine == 0, "--rollout-num-gpus",
             f"({a.rollout_num_gpus}) must be divisible by --rollout-num-gpus-per-engine ({a.rollout_num_gpus_per_engine})")
    _require(a.train_num_threads > 0, "--train-num-threads", "must be > 0")
    _require(a.actor_num_nodes > 0, "--actor-num-nodes", "must be > 0")
    _require(a.actor_num_gpus_per_node > 0, "--actor-num-gpus-per-node", "must be > 0")
    _require(a.rollout_num_gpus > 0, "--rollout-num-gpus", "must be > 0")
    _require(a.listen_host in (AUTO, "localhost") or a.listen_host in WILDCARDS[1:] or is_ip_address(a.listen_host)
             or a.listen_host in interface_addresses(), "--listen-host",
             f"{a.listen_host!r} is neither auto, an IP address nor an interface of this machine "
             f"({', '.join(sorted(interface_addresses()))})")
    actor_devices = a.actor_num_nodes * a.actor_num_gpus_per_node
    _require(not a.colocate or a.rollout_num_gpus == actor_devices, "--rollout-num-gpus",
             f"({a.rollout_num_gpus}) must equal the trainer devices ({actor_devices}) with --colocate: every device "
             f"holds a trainer rank and a share of an engine")
    _require(a.actor_num_nodes == 1 or not is_loopback(a.listen_host), "--listen-host",
             f"is {a.listen_host} (loopback) but --actor-num-nodes is {a.actor_num_nodes}: other nodes cannot reach it; "
             "leave it at auto (each node's own IP), or give an interface name or 0.0.0.0")
