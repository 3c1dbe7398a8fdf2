"""`train.py ... --dry-run [h100|h200|mi300x]`: the whole GPU command line checked on any machine, starting
nothing (model shape, plugins, SGLang and router command lines, placement, memory per GPU); exit 0, else 2."""

from __future__ import annotations

import inspect
import os
import sys

from slime.backends.sglang_utils.router import build_router_command
from slime.backends.sglang_utils.sglang_engine import build_embedded_engine_command, build_sglang_server_command
from slime.rollout.buffer import buffer_filter
from slime.rollout.simulator.gpu_presets import GPUS
from slime.upstream_flags import DEFAULTS_DIFFER, MODEL_SHAPE_FLAGS
from slime.utils.gpu_plan import effective_settings, memory_report, placement
from slime.utils.misc import load_function
from slime.utils.model_shape import ModelShapeError, read_shape, shape_from_flags

# plugin flag -> (upstream's signature, positional counts it must take, must be a coroutine; None: either)
PLUGINS = {
    "rollout_function_path": ("(args, rollout_id, data_source, evaluation=False)", (3,), None),
    "eval_function_path": ("(args, rollout_id, data_source, evaluation=False)", (3,), None),
    "custom_generate_function_path": ("async (args, sample, sampling_params)", (3,), True),
    "custom_rm_path": ("(args, sample), or (args, samples) with --group-rm", (2,), None),
    "dynamic_sampling_filter_path": ("(args, samples)", (2,), None),
    "buffer_filter_path": ("(args, rollout_id, buffer, num_samples)", (4, 3), None),
}


def _takes(fn, n: int) -> bool:
    try:
        inspect.signature(fn).bind(*range(n))
        return True
    except TypeError:
        return False


def plugin_problems(args) -> list[str]:
    """Each plugin's dotted path imported and its signature checked against upstream's contract."""
    problems = []
    for name, (contract, counts, is_async) in PLUGINS.items():
        path = vars(args)[name]
        if path is None:
            continue
        flag = "--" + name.replace("_", "-")
        try:
            fn = load_function(path)
            if name == "buffer_filter_path":
                buffer_filter(path)  # the buffer's own loader: it refuses what it could not call
        except Exception as e:  # noqa: BLE001 - an import error of any kind is the user's to see
            problems.append(f"{flag} {path}: {type(e).__name__}: {e}")
            continue
        if not callable(fn):
            problems.append(f"{flag} {path}: is a {type(fn).__name__}, not a function {contract}")
        elif not any(_takes(fn, n) for n in counts):
            problems.append(f"{flag} {path}: its signature {inspect.signature(fn)} does not take upstream's {contract}")
        elif is_async and not inspect.iscoroutinefunction(fn):
            problems.append(f"{flag} {path}: must be an async function {contract}")
    if args.agent_env is not None:
        from slime.utils.tool_calls import AgentEnv

        try:
            env = load_function(args.agent_env)
        except Exception as e:  # noqa: BLE001
            problems.append(f"--agent-env {args.agent_env}: {type(e).__name__}: {e}")
        else:
            if not isinstance(env, AgentEnv):
                problems.append(f"--agent-env {args.agent_env}: is a {type(env).__name__}, not an AgentEnv")
    return problems


def upstream_defaults_left(args) -> list[str]:
    """The flags of DEFAULTS_DIFFER this command line does not give, with this run's value and upstream's default."""
    entries, shape = [], []
    for flag, (upstream, here) in DEFAULTS_DIFFER.items():
        if flag in args.given_flags:  # under any of its names
            continue
        if flag in MODEL_SHAPE_FLAGS:
            shape.append(flag)
            continue
        dest = flag[2:].replace("-", "_")  # a flag that is not one of ours by this name: what the table says
        entries.append(f"  {flag} {_shown(vars(args)[dest]) if dest in vars(args) else here} (upstream: {upstream})")
    if shape:
        entries.append(f"  {', '.join(shape)}: from --hf-checkpoint's config.json (upstream: these flags)")
    if not entries:
        return []
    return ["defaults that differ from upstream slime's, left to them by this command line (docs/upstream-flags.md "
            "says why):", *entries]


def _shown(value) -> str:
    return "unset" if value is None else ("on" if value else "off") if isinstance(value, bool) else str(value)


def missing_paths(args) -> list[str]:
    """The paths of the command line that are not on this machine (they may be on the GPU machines)."""
    wanted = [("--hf-checkpoint", args.hf_checkpoint, os.path.isdir), ("--prompt-data", args.prompt_data, os.path.isfile),
              ("--ref-load", args.ref_load, os.path.isdir)]
    if args.load != args.save:  # --load = --save: a first run starts fresh and creates it
        wanted.append(("--load", args.load, os.path.isdir))
    wanted += [(f"--eval-prompt-data {name}", path, os.path.isfile) for name, path in args.eval_datasets]
    return [f"{flag} {path}" for flag, path, exists in wanted if path is not None and not exists(path)]


def model_shape(args):
    """(shape, where it came from), or (None, why not)."""
    if os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
        shape = read_shape(args.hf_checkpoint)  # parse_args has checked it and the shape flags against it
        return shape, f"{args.hf_checkpoint}/config.json ({shape.model_type}); the model-shape flags agree with it"
    try:
        return shape_from_flags(args), ("the model-shape flags (MODEL_ARGS): --hf-checkpoint is not on this machine, "
                                        "so they are not checked against its config.json here")
    except ModelShapeError as e:
        return None, f"--hf-checkpoint is not on this machine and {e}: no memory estimate"


def dry_run(entry: str, args, out=None) -> int:
    say = lambda line="": print(line, file=out or sys.stdout)  # noqa: E731
    problems = plugin_problems(args)
    card = GPUS[args.dry_run]
    say(f"{entry} --dry-run: the command line parses and validates for {card.name} GPUs")
    say("  " + effective_settings(args))
    missing = missing_paths(args)
    for line in missing:
        say(f"  not on this machine (checked again when the run starts): {line}")
    shape, source = model_shape(args)
    say(f"  model: {source}")
    for line in upstream_defaults_left(args):
        say(line)
    say("placement (bundle order; colocated: every GPU holds a trainer rank and a share of an engine):"
        if args.colocate else "placement (bundle order):")
    for line in placement(args):
        say("  " + line)
    try:
        engine = (build_embedded_engine_command(args, 0, 0) if args.rollout_backend == "embedded"
                  else build_sglang_server_command(args, 0, 0, 0, 0))
        say("engine 0: " + " ".join(engine[1:]))
        say("router: " + " ".join(build_router_command(args, "127.0.0.1", 0, 0)[1:]))
    except ValueError as e:
        problems.append(str(e))
    fits = True
    if shape is not None:
        try:
            lines, fits = memory_report(args, shape, card.name, card.memory_bytes)
        except ValueError as e:
            problems.append(str(e))
        else:
            for line in lines:
                say(line)
    if not fits:
        say(f"WARNING: the fullest GPU would need more than the {card.name}'s memory: lower "
            "--sglang-mem-fraction-static or --max-tokens-per-gpu, add --recompute-granularity full, raise "
            "--tensor-model-parallel-size, keep the default offload / distributed optimizer / bf16")
    for p in problems:
        say(f"error: {p}")
    return 2 if problems else 0
