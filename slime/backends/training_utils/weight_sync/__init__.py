"""The trainer's side of weight sync, one home for both trainer backends.

- `updater.py`: `WeightUpdater`, the three paths of `--update-weight-mode` (distributed: a broadcast group in
  SGLang's layout, `slime/utils/weight_update_group.py`; tensor: CUDA IPC handles / shared memory; disk: a HF
  directory), SGLang's weight-update sessions around them; a backend says how its weights are gathered
  (`named_weights`) and written (`write_hf`): fsdp_utils/update_weight.py, megatron_utils/update_weight.py;
- `tensor.py`: the tensor path's buckets and feeding ranks; `payload.py`: SGLang's `/update_weights_from_tensor`
  payload; `feed.py`: which trainer rank feeds which engine;
- `hf_dir.py`: a plain HF directory from HF-named tensors (the disk path, exports, conversions);
- `engine_calls.py`: the checked POSTs to the engines.

The driver calls the push explicitly (`TrainingRun.push_weights` -> `RayTrainGroup.update_weights` -> each rank's
`Trainer.update_weights` -> its `WeightUpdater.update`); no trainer backend imports another.
"""

from slime.backends.training_utils.weight_sync.feed import EngineFeed, feed_plan
from slime.backends.training_utils.weight_sync.hf_dir import TOKENIZER_FILES, write_hf_dir
from slime.backends.training_utils.weight_sync.updater import WeightUpdater

__all__ = ["EngineFeed", "TOKENIZER_FILES", "WeightUpdater", "feed_plan", "write_hf_dir"]
