# DeepSeek-R1-Distill-Qwen-1.5B (a Qwen2 model: q/k/v biases, no q/k norm): Megatron model-shape flags
# (MODEL_ARGS, as in slime's scripts/models/). With --hf-checkpoint each flag is checked against its
# config.json; a mismatch fails naming the flag.
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 1536
   --ffn-hidden-size 8960
   --num-attention-heads 12
   --group-query-attention
   --num-query-groups 2
   --use-rotary-position-embeddings
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 10000
   --vocab-size 151936
   --untie-embeddings-and-output-weights
)
