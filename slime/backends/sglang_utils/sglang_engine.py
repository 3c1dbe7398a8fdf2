"""Launch one rollout engine as a child HTTP server: real SGLang (`sglang.launch_server`, on a GPU or on CPU with
the flags and import stand-ins below), or our embedded transformers engine; both speak SGLang's native HTTP API."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys

from slime.utils import sglang_versions as versions
from slime.backends.sglang_utils.process_utils import ManagedProcess
from slime.utils.net import WILDCARDS, advertised_address, resolve_listen_host

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
BACKENDS = ("auto", "embedded", "sglang")

# Flags this launcher sets itself, mapped to the slime flag that controls them.
_RESERVED_SGLANG_FLAGS = {
    "model-path": "--hf-checkpoint",
    "tp-size": "--rollout-num-gpus-per-engine",
    "tp": "--rollout-num-gpus-per-engine",
    "tensor-parallel-size": "--rollout-num-gpus-per-engine",
    "port": "(picked automatically)",
    "nccl-port": "(picked automatically)",
    "base-gpu-id": "(derived from the engine rank)",
}


# SGLang's server on a CPU box (docs/sglang-compat.md), each unless the user passes the same `--sglang-<flag>`
CPU_LAUNCH_FLAGS = {
    "device": "cpu", "attention-backend": "torch_native", "sampling-backend": "pytorch", "disable-cuda-graph": True,
    "dtype": "float32", "grammar-backend": "none", "skip-server-warmup": True, "mem-fraction-static": "0.1",
    "max-total-tokens": "16384",
}
# first on a CPU SGLang server's PYTHONPATH only (cpu_stand_ins/README.md)
CPU_STAND_INS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_stand_ins")


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # torch missing or broken CUDA init: no GPU for us
        return False


def _sglang_importable(python: str | None = None) -> bool:
    """Whether `python` (default: this interpreter) can import sglang."""
    if python is None or os.path.abspath(python) == os.path.abspath(sys.executable):  # a venv's is a symlink
        return importlib.util.find_spec("sglang") is not None
    try:
        out = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') "
                                            "is None)"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def resolve_rollout_backend(args) -> str:
    """'sglang' or 'embedded' from `--rollout-backend` (auto: sglang iff CUDA and sglang are both available)."""
    choice = args.rollout_backend
    if choice not in BACKENDS:
        raise ValueError(f"--rollout-backend: {choice!r} is not one of {BACKENDS}")
    if choice == "auto":
        cuda = _cuda_available()
        has_sglang = cuda and _sglang_importable(args.sglang_python)
        backend = "sglang" if has_sglang else "embedded"
        logger.info("--rollout-backend auto -> %s (cuda available: %s, sglang importable: %s)", backend, cuda, has_sglang)
        return backend
    if choice == "sglang" and not _sglang_importable(args.sglang_python):
        where = f"--sglang-python {args.sglang_python}" if args.sglang_python else f"this Python ({sys.executable})"
        raise RuntimeError(f"--rollout-backend sglang: {where} cannot import `sglang` (on a GPU machine: pip install "
                           f"'{versions.sglang_requirement()}'; on a CPU box: python tools/sglang_cpu_env.py "
                           "install, then --sglang-python (or $SLIME_SGLANG_PYTHON) set to what "
                           "`python tools/sglang_cpu_env.py python` prints)")
    logger.info("--rollout-backend %s", choice)
    return choice


def _extra_args_to_argv(extra: dict, prefix: str, reserved: dict[str, str]) -> list[str]:
    argv: list[str] = []
    for name, value in (extra or {}).items():
        flag = name[2:] if name.startswith("--") else name
        flag = flag.replace("_", "-")
        if flag in reserved:
            raise ValueError(f"--{prefix}{flag} cannot be passed through: this launcher sets --{flag} itself {reserved[flag]}")
        if value is True:
            argv.append(f"--{flag}")
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [f"--{flag}", *(str(v) for v in value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv


def _extra_flag_names(extra: dict | None) -> set[str]:
    return {(k[2:] if k.startswith("--") else k).replace("_", "-") for k in (extra or {})}


def build_sglang_server_command(args, engine_rank: int, port: int, nccl_port: int, base_gpu_id: int,
                                host: str = DEFAULT_HOST, cpu: bool = False) -> list[str]:
    """`<--sglang-python> -m sglang.launch_server ...` for engine `engine_rank`, then every `--sglang-<flag>`; `cpu`:
    no CUDA here (the CPU flags are added, `--colocate` is refused)."""
    if not args.hf_checkpoint:
        raise ValueError("--hf-checkpoint is required to launch SGLang engines (it becomes --model-path)")
    extra = dict(args.sglang_extra_args)
    names = _extra_flag_names(extra)
    tp = args.rollout_num_gpus_per_engine
    cmd = [
        args.sglang_python or sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(args.hf_checkpoint),
        "--tp-size", str(tp),
        "--port", str(port),
        "--base-gpu-id", str(base_gpu_id),
        "--nccl-port", str(nccl_port),
    ]
    if "host" not in names:
        cmd += ["--host", host]
    if "random-seed" not in names:
        cmd += ["--random-seed", str(args.seed + engine_rank)]
    if "weight-version" not in names:
        cmd += ["--weight-version", "0"]
    if cpu:
        if args.colocate:
            raise ValueError("--colocate with --rollout-backend sglang needs a GPU: SGLang releases its memory through "
                             "torch_memory_saver, which has no CPU build (on CPU: --rollout-backend embedded)")
        cmd += _extra_args_to_argv({k: v for k, v in CPU_LAUNCH_FLAGS.items() if k not in names}, "", {})
    elif args.colocate and "enable-memory-saver" not in names:
        cmd += ["--enable-memory-saver"]  # /release_memory_occupation frees the GPU memory only with it
    cmd += _extra_args_to_argv(extra, "sglang-", _RESERVED_SGLANG_FLAGS)
    return cmd


def build_embedded_engine_command(args, engine_rank: int, port: int, host: str = DEFAULT_HOST) -> list[str]:
    """`python -m slime.backends.hf_engine ...` for engine `engine_rank`; an `--sglang-<flag>` passes through when
    the embedded engine has the same flag, any other is refused by name."""
    if not args.hf_checkpoint:
        raise ValueError("--hf-checkpoint is required to launch the embedded engine (it becomes --model-path)")
    cmd = [
        sys.executable, "-m", "slime.backends.hf_engine",
        "--model-path", str(args.hf_checkpoint),
        "--host", host,
        "--port", str(port),
    ]
    cmd += ["--num-threads", str(args.embedded_engine_threads), "--seed", str(args.seed + engine_rank)]
    names = _extra_flag_names(args.sglang_extra_args)
    if args.colocate and "enable-memory-saver" not in names:
        cmd += ["--enable-memory-saver"]  # as for SGLang: colocated engines release their memory around training
    if "weight-version" not in names:
        cmd += ["--weight-version", "0"]  # as for SGLang: the policy version the engine starts with
    known = _embedded_engine_flags()
    unknown = sorted(f for f in names if f not in known)
    if unknown:
        raise ValueError(f"--sglang-{unknown[0]}: the embedded engine (--rollout-backend embedded) has no --{unknown[0]}; "
                         f"SGLang flags it understands: {', '.join('--sglang-' + f for f in sorted(known))}")
    cmd += _extra_args_to_argv(args.sglang_extra_args, "sglang-",
                               {"model-path": "--hf-checkpoint", "host": "", "port": "(picked automatically)",
                                "num-threads": "--embedded-engine-threads", "seed": "--seed"})
    return cmd


def _embedded_engine_flags() -> set[str]:
    """The embedded engine's own flag names (SGLang's where they mean the same)."""
    from slime.backends.hf_engine.__main__ import build_parser

    return {opt[2:] for action in build_parser()._actions for opt in action.option_strings if opt.startswith("--")}


class EngineProcess:
    """One launched engine server (either backend) and how to reach it."""

    def __init__(self, name: str, backend: str, cmd: list[str], host: str, port: int, log_path: str,
                 env: dict[str, str] | None = None):
        self.name = name
        self.backend = backend
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self.process = ManagedProcess(name, cmd, log_path, env=env)

    def start(self) -> "EngineProcess":
        self.process.start()
        return self

    def wait_healthy(self, timeout: float) -> float:
        """Wait until GET /health_generate answers 200; raises ServerLaunchError naming the engine with its log tail."""
        waited = self.process.wait_http_ok(self.url + "/health_generate", timeout)
        logger.info("%s healthy at %s after %.1fs", self.name, self.url, waited)
        return waited



def make_engine_process(args, backend: str, engine_rank: int, port: int, log_dir: str,
                        nccl_port: int | None = None, host: str = DEFAULT_HOST,
                        gpu_ids: tuple[str, ...] | None = None) -> EngineProcess:
    """Build (not start) engine `engine_rank` for `backend`. `gpu_ids`: its bundles' GPUs (it sees exactly those);
    without them engines of one node share the visible GPUs in rank order."""
    env = dict(os.environ)
    if backend == "sglang":
        tp = args.rollout_num_gpus_per_engine
        cpu = not gpu_ids and not _cuda_available()
        # on CPU SGLang reads the GPU id as the NUMA node to bind its threads to: every engine takes node 0
        base_gpu_id = 0 if gpu_ids or cpu else engine_rank * tp
        if nccl_port is None:
            raise ValueError("make_engine_process: an SGLang engine needs an nccl_port")
        cmd = build_sglang_server_command(args, engine_rank, port, nccl_port, base_gpu_id, host, cpu=cpu)
        host = cmd[cmd.index("--host") + 1] if "--host" in cmd else host  # a user's --sglang-host
        if cpu:
            env["SGLANG_USE_CPU_ENGINE"] = "0"  # its own CPU path needs sgl_kernel's CPU build (no wheel has it)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (CPU_STAND_INS, env.get("PYTHONPATH")) if p)
            env.setdefault("OMP_NUM_THREADS", "1")  # as for the embedded engine: one core per engine here
        if gpu_ids:
            if len(gpu_ids) != tp:
                raise ValueError(f"engine {engine_rank}: {len(gpu_ids)} GPU(s) {list(gpu_ids)} from its bundles, but "
                                 f"--rollout-num-gpus-per-engine is {tp}")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
            if "HIP_VISIBLE_DEVICES" in env or "ROCR_VISIBLE_DEVICES" in env:  # ROCm: Ray set these for the actor
                env["HIP_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
                env.pop("ROCR_VISIBLE_DEVICES", None)
        elif env.get("CUDA_VISIBLE_DEVICES") == "":
            # Ray hides every GPU from an actor that asked for none; the engines we spawn need them.
            logger.warning("CUDA_VISIBLE_DEVICES is empty in the launching process (a GPU-less Ray actor?); "
                           "unsetting it for %s so --base-gpu-id %d refers to the node's GPUs", f"engine {engine_rank}",
                           base_gpu_id)
            env.pop("CUDA_VISIBLE_DEVICES")
    elif backend == "embedded":
        cmd = build_embedded_engine_command(args, engine_rank, port, host)
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        raise ValueError(f"unknown rollout backend {backend!r} (expected 'sglang' or 'embedded')")
    # a wildcard bind is reached at this node's address in a multi-node run, at loopback on one machine
    connect_host = advertised_address(resolve_listen_host("auto")) if host in WILDCARDS else host
    log_path = os.path.join(log_dir, f"engine_{engine_rank}.log")
    return EngineProcess(f"engine {engine_rank} ({backend})", backend, cmd, connect_host, port, log_path, env=env)
