"""The algorithm: advantages, the policy loss and its clips, KL and entropy terms, the off-policy correction."""

from __future__ import annotations

import argparse

from slime.arguments.base import Args, _require


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("algorithm")
    g.add_argument("--advantage-estimator", choices=["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"],
                   default="grpo")
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None, help="default: --eps-clip")
    g.add_argument("--eps-clip-c", type=float, default=None, help="dual-clip bound (> 1) for negative advantages")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty folded into the reward (REINFORCE++)")
    g.add_argument("--gamma", type=float, default=1.0, help="discount for REINFORCE++ token returns")
    g.add_argument("--use-kl-loss", action="store_true")
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", choices=["k1", "k2", "k3", "low_var_kl"], default="k1")
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--disable-grpo-std-normalization", action="store_true")
    g.add_argument("--normalize-advantages", action="store_true")
    g.add_argument("--calculate-per-token-loss", action="store_true", help="token-mean loss (default: per-sample mean)")
    g.add_argument("--loss-type", choices=["policy_loss", "sft_loss", "custom_loss"], default="policy_loss",
                   help="custom_loss (upstream's) is refused: its function gets Megatron's sharded logits and "
                        "upstream's batch dict, which this trainer does not build")
    g.add_argument("--use-tis", action="store_true", help="truncated importance sampling against behaviour log-probs")
    g.add_argument("--tis-clip", type=float, default=2.0)
    g.add_argument("--tis-clip-low", type=float, default=0.0)
    g.add_argument("--get-mismatch-metrics", action="store_true",
                   help="upstream's; always on here: train/ reports the engine vs trainer log-prob mismatch every step")


def fill_defaults(a: Args) -> None:
    if a.eps_clip_high is None:
        a.eps_clip_high = a.eps_clip


def check(a: Args, entry: str) -> None:
    _require(a.eps_clip > 0 and a.eps_clip_high > 0, "--eps-clip", "clip ranges must be > 0")
    _require(0.0 <= a.gamma <= 1.0, "--gamma", "must be in [0, 1]")
    _require(a.eps_clip_c is None or a.eps_clip_c > 1.0, "--eps-clip-c", "must be > 1 (dual clip lower bound)")
    _require(a.tis_clip > 0 and 0 <= a.tis_clip_low < a.tis_clip, "--tis-clip",
             "need 0 <= --tis-clip-low < --tis-clip")
    _require(a.loss_type != "custom_loss", "--loss-type custom_loss",
             "is not supported: upstream's custom loss function gets Megatron's vocabulary-sharded logits and upstream's "
             "batch dict, which this trainer does not build; use --loss-type policy_loss (shaped by "
             "--advantage-estimator, --eps-clip / --eps-clip-high / --eps-clip-c, --use-tis, --use-kl-loss, "
             "--entropy-coef, --calculate-per-token-loss) or sft_loss, with your reward in --custom-rm-path")
