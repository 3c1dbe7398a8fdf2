"""Process-level set-up for a run: run directory, logging, offline defaults, Ray."""

from __future__ import annotations

import logging
import os

from slime.utils.net import WILDCARDS, advertised_address
from slime.utils.ray_reaper import start_reaper

logger = logging.getLogger(__name__)

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Ray 2.60: keep every Ray server on 127.0.0.1 and do not write an auth token.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
}


def resolve_run_dir(args) -> str:
    """`--run-dir` (parse_args fills its default, runs/<date-time>), absolute."""
    return os.path.abspath(args.run_dir)


def setup_logging(run_dir: str, level: int = logging.INFO) -> None:
    os.makedirs(run_dir, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.setLevel(level)
    for h in list(root.handlers):
        root.removeHandler(h)
    console = logging.StreamHandler()
    console.setFormatter(fmt)
    file = logging.FileHandler(os.path.join(run_dir, "train.log"))
    file.setFormatter(fmt)
    root.addHandler(console)
    root.addHandler(file)
    for noisy in ("httpx", "urllib3", "aiohttp.access", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def set_offline_defaults() -> None:
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)


def init_ray(num_cpus: int | None = None, listen_host: str = "127.0.0.1") -> None:
    """Start (or join, if RAY_ADDRESS is set) Ray; a local Ray node listens on `listen_host`
    (`--listen-host`, loopback by default: Ray binds its servers to the node address)."""
    import ray

    set_offline_defaults()
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        node_ip = None if listen_host in WILDCARDS else advertised_address(listen_host)
        ray.init(address="local", num_cpus=num_cpus or max(8, os.cpu_count() or 2),
                 include_dashboard=False, log_to_driver=True, _node_ip_address=node_ip)
        start_reaper()  # its agents would outlive a SIGKILLed driver by ~60 s
        actual = ray.util.get_node_ip_address()
        if node_ip is not None and actual != node_ip:
            logger.warning("the local Ray node listens on %s, not --listen-host %s: Ray was imported before "
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set (call set_offline_defaults() first)", actual, node_ip)
    logger.info("ray initialised: %s", ray.cluster_resources())
