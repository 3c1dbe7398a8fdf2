"""Process-level set-up for a run: run directory, logging, offline defaults, Ray."""

from __future__ import annotations

import json
import logging
import os

from slime.utils.net import WILDCARDS, advertised_address, interface_addresses, resolve_listen_host
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


# Passed to every Ray worker of the run: the offline switches and the driver's collective settings.
WORKER_ENV_KEYS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM",
                   "HF_HOME", "WANDB_MODE")
WORKER_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_")
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by `ray job submit` for the entry point (its runtime_env)


def code_root() -> str:
    """The directory that holds the `slime` package this process imports."""
    import slime

    return os.path.dirname(os.path.dirname(os.path.abspath(slime.__file__)))


def worker_python_path() -> str:
    """PYTHONPATH for Ray workers: this checkout, the driver's cwd (plugins), then the driver's own, all absolute."""
    entries = [code_root(), os.getcwd()]
    entries += [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(entries))


def job_runtime_env(listen_host: str = "auto") -> dict:
    """The Ray job's runtime_env (PYTHONPATH, offline switches, NCCL/GLOO settings), less the keys a submitted
    job's own runtime_env sets (Ray refuses a conflict)."""
    env = {k: os.environ[k] for k in WORKER_ENV_KEYS if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith(WORKER_ENV_PREFIXES)})
    if listen_host in interface_addresses():
        env.setdefault("GLOO_SOCKET_IFNAME", listen_host)
        env.setdefault("NCCL_SOCKET_IFNAME", listen_host)
    env["PYTHONPATH"] = worker_python_path()
    job = json.loads(os.environ.get(RAY_JOB_CONFIG_ENV, "{}") or "{}").get("runtime_env") or {}
    for key in job.get("env_vars") or {}:
        env.pop(key, None)
    if job.get("working_dir") or job.get("py_modules"):
        env.pop("PYTHONPATH", None)
    return {"env_vars": env}


def process_placement(_actor=None) -> dict:
    """Where this process runs and which code it imports (placement.json; `_actor`: run inside any actor)."""
    import socket

    info = {"hostname": socket.gethostname(), "pid": os.getpid(), "code_root": code_root(), "node_id": None,
            "node_ip": None}
    try:
        import ray

        if ray.is_initialized():
            info["node_id"] = ray.get_runtime_context().get_node_id()
            info["node_ip"] = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        pass
    return info


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


def init_ray(num_cpus: int | None = None, listen_host: str = "auto") -> None:
    """Join the Ray cluster at RAY_ADDRESS, or start a local node on `listen_host`; workers get `job_runtime_env`."""
    import ray

    set_offline_defaults()
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    runtime_env = job_runtime_env(listen_host)
    if address:
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
        logger.info("joined the Ray cluster at %s (%d node(s))", address, len([n for n in ray.nodes() if n["Alive"]]))
    else:
        host = resolve_listen_host(listen_host)
        node_ip = None if host in WILDCARDS else advertised_address(host)
        ray.init(address="local", num_cpus=num_cpus or max(8, os.cpu_count() or 2),
                 include_dashboard=False, log_to_driver=True, _node_ip_address=node_ip, runtime_env=runtime_env)
        start_reaper()  # its agents would outlive a SIGKILLed driver by ~60 s
        actual = ray.util.get_node_ip_address()
        if node_ip is not None and actual != node_ip:
            logger.warning("the local Ray node listens on %s, not --listen-host %s: Ray was imported before "
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set (call set_offline_defaults() first)", actual, node_ip)
    logger.info("ray initialised: %s", ray.cluster_resources())
