# The quick start's tiny Qwen3 (tools/prepare_tiny_task.py: runs/tiny/model-sft): Megatron model-shape flags.
# With --hf-checkpoint each flag is checked against its config.json; a mismatch fails naming the flag.
MODEL_ARGS=(
   --swiglu
   --num-layers 4
   --hidden-size 128
   --ffn-hidden-size 256
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 10000
   --vocab-size 16
   --kv-channels 32
   --qk-layernorm
   --untie-embeddings-and-output-weights
)
