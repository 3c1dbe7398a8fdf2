"""--pause-mode abort vs retract vs in_place: train_async.py's stream rollout across weight updates, side by side.

The rollout side of `train_async.py --rollout-mode stream` (AsyncRollout over the embedded engine behind the real
router, the run's own RolloutManager and buffer), with the trainer stood in: each step takes a batch, "trains" for
`--train-seconds` (the engines go on meanwhile), then pushes a weight update from disk (the same weights, a real
load) as `updating_weights` does it for the mode: abort drains and resumes, retract and in_place pause the engines
(in_place: `flush_cache: false`). The workload is the subtract_chain task's prompts with ignore_eos and each
sample's budget `--scale` x its true answer length, so the long tail crosses updates. Each mode keeps its own
manager (buffer, data position, same seed), engine and rollout, frozen between its rounds (gate held, engine
paused in place: nothing parked); rounds run every mode in turn for `--steps` steps, so the box's drift hits them
alike.

Per mode, over the measured rounds: trained samples/s (samples handed to the trainer / wall time of the steps,
training and updates included), rollout tokens/s, tokens re-prefilled per step (the engine's prefilled tokens
minus the fresh prompts': what aborts, retractions and flushed caches made it compute again), requests per step,
the off-policy token ratio. The last line is JSON.

    python benchmarks/pause_modes.py [--rounds 3] [--steps 6] [--train-seconds 0.5] [--scale 4]

Results, box and date: benchmarks/README.md (its `--pause-mode` row).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slime.utils.run import set_offline_defaults  # noqa: E402

set_offline_defaults()  # before anything imports Ray: its node then listens on loopback
from rollout_report import spread  # noqa: E402
from rollout_workload import engine_stats  # noqa: E402

from slime.arguments import parse_args  # noqa: E402
from slime.backends.sglang_utils.engine_group import EngineGroup  # noqa: E402
from slime.ray.async_rollout import AsyncRollout  # noqa: E402
from slime.ray.rollout import RolloutManager  # noqa: E402
from slime.rollout.simulator.probes import stats_delta  # noqa: E402
from slime.tasks.subtract_chain import VOCAB, write_dataset  # noqa: E402
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer  # noqa: E402

logger = logging.getLogger("pause_modes")
MODES = ("abort", "retract", "in_place")


class Mode:
    """One pause mode: its own engine (behind its own router), manager (buffer, data source) and rollout, running
    only while measured: between its rounds the rollout's gate is held and its engine paused in place, so its
    requests wait with their KV (nothing parked, nothing re-prefilled by the benchmark itself)."""

    def __init__(self, name: str, args, run_dir: str, scale: int):
        self.name, self.args = name, args
        self.engines = EngineGroup(args, log_dir=os.path.join(run_dir, "logs")).start()
        self.manager = RolloutManager(args, run_dir, start_engines=False)
        self.manager.attach_engines(self.engines)
        self.fresh_prompt_tokens = 0
        source, get_groups = self.manager.data_source, self.manager.data_source.get_groups

        def budgeted(num):  # each sample's budget: `scale` x its prompt's true answer length (tokens + EOS)
            groups = get_groups(num)
            for g in groups:
                for s in g:
                    s.metadata["max_response_len"] = scale * (len(s.label) + 1)
                    self.fresh_prompt_tokens += len(s.tokens)
            return groups

        source.get_groups = budgeted
        self.step = self.version = 0
        self.rollout = AsyncRollout(args, self.manager, 0).start()
        self._freeze()
        self.totals = {"samples": 0, "wall_s": 0.0, "new_tokens": 0.0, "reprefill": 0, "requests": 0, "steps": 0,
                       "off": 0.0, "trained_tokens": 0.0}
        self.rounds: list[float] = []

    def _freeze(self) -> None:
        r = self.rollout
        r._call(r.gate.hold("benchmark", self.engines, drain=False), 60)
        r._call(self.engines.pause("in_place", r.rollout.link.session), 60)

    def _thaw(self) -> None:
        self.rollout._call(self.engines.continue_generation(self.rollout.rollout.link.session), 60)
        self.rollout.loop.call_soon_threadsafe(self.rollout.gate.release, "benchmark")

    def run(self, steps: int, train_s: float, model_dir: str, measure: bool) -> None:
        self._thaw()
        e0, p0 = engine_stats(self.engines), self.fresh_prompt_tokens
        samples = wall = off = trained = 0.0
        try:
            for _ in range(steps):
                t0 = time.monotonic()
                batch = self.rollout.next_batch(self.step)
                self.manager.mark_trained(batch.groups)
                time.sleep(train_s)  # the trainer trains; the engines go on
                self.version += 1
                with self.rollout.updating_weights(self.version) as flush_cache:
                    self.engines.weights.from_disk(model_dir, self.version, flush_cache=flush_cache)
                self.manager.set_policy_version(self.version)
                wall += time.monotonic() - t0
                samples += sum(len(g) for g in batch.groups)
                off += batch.metrics["rollout/off_policy_tokens"]
                trained += batch.metrics["rollout/trained_tokens"]
                self.step += 1
        finally:
            self._freeze()
        d = stats_delta(engine_stats(self.engines), e0)
        reprefill = d.get("prefill_tokens", 0) - (self.fresh_prompt_tokens - p0)
        if measure:
            t = self.totals
            t["samples"] += samples
            t["wall_s"] += wall
            t["new_tokens"] += d.get("sampled_tokens", 0)
            t["off"] += off
            t["trained_tokens"] += trained
            t["reprefill"] += reprefill
            t["requests"] += d.get("requests_in", 0)
            t["steps"] += steps
            self.rounds.append(samples / wall)
        logger.info("%s: %d steps, %.2f samples/s, re-prefilled %d tokens, %d requests", self.name, steps,
                    samples / wall, reprefill, d.get("requests_in", 0))

    def close(self) -> None:
        self._thaw()
        self.rollout.stop()
        self.engines.shutdown()

    def result(self) -> dict:
        t = self.totals
        return {"samples_per_s": t["samples"] / t["wall_s"], "tokens_per_s": t["new_tokens"] / t["wall_s"],
                "reprefill_tokens_per_step": t["reprefill"] / t["steps"], "requests_per_step": t["requests"] / t["steps"],
                "off_policy_token_ratio": t["off"] / max(1.0, t["trained_tokens"]), "rounds": self.rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="steps per mode per round")
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--train-seconds", type=float, default=0.2, help="the stood-in trainer's time per step")
    p.add_argument("--scale", type=int, default=4, help="budget = scale x the true answer length")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--pool-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("slime", "ray"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from slime.utils.run import init_ray

    with tempfile.TemporaryDirectory(prefix="pause_modes_") as work:
        tok = build_tokenizer(VOCAB)
        model_dir = os.path.join(work, "model")
        build_tiny_qwen3(model_dir, tok, TinyQwen3Spec(hidden_size=opts.hidden, num_hidden_layers=opts.layers,
                                                       num_attention_heads=4, num_key_value_heads=2,
                                                       intermediate_size=2 * opts.hidden,
                                                       max_position_embeddings=opts.scale * 200 + 64), seed=0)
        write_dataset(os.path.join(work, "prompts.jsonl"), 20000, seed=opts.seed)

        def args(mode: str):
            return parse_args([
                "--hf-checkpoint", model_dir, "--prompt-data", os.path.join(work, "prompts.jsonl"),
                "--label-key", "label", "--rm-type", "subtract_chain", "--num-rollout", "100000",
                "--rollout-backend", "embedded", "--rollout-batch-size", str(opts.batch),
                "--n-samples-per-prompt", str(opts.n), "--rollout-max-response-len", str(opts.scale * 200),
                "--rollout-ignore-eos", "--rollout-mode", "stream", "--partial-rollout",
                "--rollout-pool-size", str(opts.pool_size), "--max-async-lag", "1", "--pause-mode", mode,
                "--rollout-seed", str(opts.seed), "--run-dir", os.path.join(work, f"run_{mode}")],
                entry="train_async.py")

        init_ray(num_cpus=2)
        modes = {}
        try:
            for m in opts.modes:
                modes[m] = Mode(m, args(m), os.path.join(work, f"run_{m}"), opts.scale)
            for m in modes.values():
                m.run(opts.warmup_steps, opts.train_seconds, model_dir, measure=False)
            loads = []
            for r in range(opts.rounds):
                for m in modes.values():
                    m.run(opts.steps, opts.train_seconds, model_dir, measure=True)
                loads.append(round(os.getloadavg()[0], 2))
                print(f"round {r}: " + "  ".join(f"{k} {m.rounds[-1]:.2f}" for k, m in modes.items())
                      + f" trained samples/s; load {loads[-1]}", flush=True)
        finally:
            for m in modes.values():
                m.close()
    res = {k: m.result() for k, m in modes.items()}
    base = res.get("abort")
    for k, v in res.items():
        print(f"{k:>9}: {v['samples_per_s']:6.2f} trained samples/s, {v['tokens_per_s']:7.1f} tok/s, "
              f"re-prefilled {v['reprefill_tokens_per_step']:7.1f} tokens/step, {v['requests_per_step']:5.1f} "
              f"requests/step, off-policy {v['off_policy_token_ratio']:.3f}", flush=True)
    summary = {"modes": res, "load": loads, "workload": vars(opts)}
    if base is not None:
        summary["over_abort"] = {k: spread([a / b for a, b in zip(v["rounds"], base["rounds"])]) for k, v in res.items()}
    print(json.dumps(summary))
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
