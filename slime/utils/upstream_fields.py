"""Upstream slime's `Sample` fields (at 624b824) that have no meaning here, each with why: a plugin reads
upstream's default (slime/utils/types.py sets them on `Sample`), and a sample that comes back from a plugin with
another value is refused (`Sample.check_upstream_fields`)."""

from __future__ import annotations

_MULTIMODAL = "multimodal inputs are not supported here (text models only)"
_TOP_P = "top-p token replay is not supported here (the trainer's log-probs are over the whole vocabulary)"
UNSUPPORTED_FIELDS: dict[str, str] = {
    "multimodal_inputs": _MULTIMODAL, "multimodal_train_inputs": _MULTIMODAL,
    "multimodal_train_input_id": _MULTIMODAL,
    "apply_chat_template_kwargs": "per-sample chat-template arguments are not supported (--apply-chat-template "
                                  "applies the tokenizer's own template)",
    "rollout_top_p_token_ids": _TOP_P, "rollout_top_p_token_offsets": _TOP_P,
    "rollout_routed_experts": "MoE routing replay is not supported (dense models)",
    "teacher_log_probs": "on-policy distillation is not supported",
    "train_metadata": "it is read by upstream's custom losses, which are not supported (--loss-type policy_loss "
                      "or sft_loss)",
    "generate_function_path": "a per-sample generate is not supported: every sample goes through "
                              "--custom-generate-function-path",
    "custom_rm_path": "a per-sample reward function is not supported: every sample is rewarded by --custom-rm-path "
                      "or --rm-type",
}
