# SmolLM2-135M-Instruct (a Llama: no q/k norm, no biases, RoPE base 100000, tied embeddings; tools/convert_smollm2.py
# makes its fp32 HF directory): Megatron model-shape flags. With --hf-checkpoint each flag is checked against its
# config.json; a mismatch fails naming the flag.
MODEL_ARGS=(
   --swiglu
   --num-layers 30
   --hidden-size 576
   --ffn-hidden-size 1536
   --num-attention-heads 9
   --group-query-attention
   --num-query-groups 3
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --rotary-base 100000
   --vocab-size 49152
   --kv-channels 64
)
