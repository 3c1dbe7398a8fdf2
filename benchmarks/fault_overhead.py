"""What the engine watchdog and the fault checks cost a quick-start step.

Side by side in one run, on the quick start's task and model (one embedded engine behind sglang-router):
quick-start rollout steps (APRIL, 8 groups x 8 samples, 192-token budget) alternately with the watchdog at its
defaults (process state every 1 s, GET /health_generate every --rollout-health-check-interval 10 s) and with it
off (interval 0). The step times are noisy on a shared box, so the watchdog's own work is also timed directly:
a process check, an HTTP health probe (client round trip; the engine does a 1-token generate), and how many of
each a step makes; plus the per-step driver checks (trainable-sample count) and the one-off start checks
(model dir, --save, checkpoint verification).

    python benchmarks/fault_overhead.py [--steps 6] [--workdir runs/tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.utils.run import set_offline_defaults  # noqa: E402

set_offline_defaults()


def quickstart_args(workdir: str, run_dir: str, interval: float):
    from slime.arguments import parse_args

    return parse_args([
        "--hf-checkpoint", f"{workdir}/model-sft", "--prompt-data", f"{workdir}/train.jsonl", "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rollout-seed", "1", "--seed", "1",
        "--rm-type", "subtract_chain", "--num-rollout", "100", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "192", "--partial-rollout", "--over-sampling-batch-size", "16",
        "--rollout-backend", "embedded", "--run-dir", run_dir, "--rollout-health-check-interval", str(interval)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="rollout steps per mode (alternating)")
    p.add_argument("--workdir", default="runs/tiny")
    a = p.parse_args(argv)
    import aiohttp
    from transformers import AutoTokenizer

    from slime.backends.sglang_utils.engine_group import EngineGroup
    from slime.backends.sglang_utils.watchdog import PROCESS_CHECK_S, EngineWatchdog
    from slime.ray.buffer import PartialRolloutBuffer
    from slime.rollout.data_source import RolloutDataSource
    from slime.rollout.sglang_rollout import engine_rollout, generate_rollout
    from slime.utils import checkpoint as ckpts
    from slime.utils.empty_steps import count_trainable
    from slime.utils.hf_dir import check_hf_checkpoint
    from slime.utils.ledger import TRAINED

    tmp = tempfile.mkdtemp(prefix="fault_overhead_")
    modes = {"watchdog": quickstart_args(a.workdir, f"{tmp}/on", 10.0), "off": quickstart_args(a.workdir, f"{tmp}/off", 0.0)}
    tok = AutoTokenizer.from_pretrained(modes["off"].hf_checkpoint)
    state = {m: (RolloutDataSource(args, tok), PartialRolloutBuffer(args)) for m, args in modes.items()}
    times: dict[str, list[float]] = {m: [] for m in modes}
    counts: list[int] = []
    with EngineGroup(modes["off"], log_dir=f"{tmp}/logs") as engines:
        for step in range(a.steps + 1):  # step 0 warms up both modes
            for mode in (("watchdog", "off") if step % 2 else ("off", "watchdog")):
                source, buffer = state[mode]
                t0 = time.perf_counter()
                out = generate_rollout(modes[mode], step, engine_rollout(modes[mode], buffer, source, engines).context())
                dt = time.perf_counter() - t0
                t1 = time.perf_counter()
                counts.append(count_trainable(out.groups))
                trainable_check_s = time.perf_counter() - t1
                buffer.mark([g[0].group_index for g in out.groups], TRAINED)
                if step:
                    times[mode].append(dt)

        async def probe_costs() -> tuple[float, float]:
            async with aiohttp.ClientSession() as session:
                wd = EngineWatchdog(modes["watchdog"], engines, session)
                t0 = time.perf_counter()
                for _ in range(200):
                    wd.check_processes()
                proc_s = (time.perf_counter() - t0) / 200
                t0 = time.perf_counter()
                for _ in range(20):
                    await wd.check_once()
                return proc_s, (time.perf_counter() - t0) / 20

        proc_check_s, health_s = asyncio.run(probe_costs())

    hf_t0 = time.perf_counter()
    check_hf_checkpoint(modes["off"].hf_checkpoint)
    ckpts.prepare_save_dir(f"{tmp}/save", ckpts.checkpoint_size_estimate(modes["off"].hf_checkpoint))
    start_checks_s = time.perf_counter() - hf_t0

    step_s = statistics.median(times["off"])
    # an upper bound: a probe's whole round trip counted as if it stalled the step (it overlaps generation)
    per_step = (step_s / PROCESS_CHECK_S) * proc_check_s + (step_s / modes["watchdog"].rollout_health_check_interval) \
        * health_s + trainable_check_s
    out = {
        "rollout_step_s_watchdog_off_median": round(step_s, 3),
        "rollout_step_s_watchdog_on_median": round(statistics.median(times["watchdog"]), 3),
        "step_times_off": [round(t, 3) for t in times["off"]],
        "step_times_on": [round(t, 3) for t in times["watchdog"]],
        "process_check_us": round(proc_check_s * 1e6, 1),
        "health_probe_ms": round(health_s * 1e3, 2),
        "trainable_count_us": round(trainable_check_s * 1e6, 1),
        "watchdog_and_checks_per_step_ms": round(per_step * 1e3, 3),
        "watchdog_and_checks_fraction_of_rollout_step": round(per_step / step_s, 5),
        "one_off_start_checks_ms": round(start_checks_s * 1e3, 1),
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
