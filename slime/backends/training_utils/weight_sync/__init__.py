"""The trainer's side of weight sync, one home for both trainer backends.

`updater.py` (`WeightUpdater`, the three `--update-weight-mode` paths), `tensor.py` and `payload.py` (the tensor
path and SGLang's payload), `feed.py` (which trainer rank feeds which engine), `hf_dir.py` (a HF directory from
HF-named tensors), `engine_calls.py` (the checked POSTs). The driver calls the push explicitly
(`TrainingRun.push_weights` -> `RayTrainGroup.update_weights` -> `Trainer.update_weights` -> `WeightUpdater.update`).
"""

from slime.backends.training_utils.weight_sync.feed import EngineFeed, feed_plan
from slime.backends.training_utils.weight_sync.hf_dir import TOKENIZER_FILES, write_hf_dir
from slime.backends.training_utils.weight_sync.updater import WeightUpdater

__all__ = ["EngineFeed", "TOKENIZER_FILES", "WeightUpdater", "feed_plan", "write_hf_dir"]
