"""The partial-rollout buffer as a Ray actor: one owner of the parked and ready groups and the ledger for the
whole run (the class itself is slime/rollout/buffer.py). `Buffer` is made on first use, so importing this module
needs no Ray (the rollout benchmark runs where Ray is not installed)."""

from slime.rollout.buffer import PartialRolloutBuffer


def __getattr__(name: str):
    if name == "Buffer":  # the Ray actor class; Ray is imported only by those who ask for it
        import ray

        actor = ray.remote(num_cpus=0)(PartialRolloutBuffer)
        globals()["Buffer"] = actor
        return actor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PartialRolloutBuffer"]  # and Buffer, made on first use
