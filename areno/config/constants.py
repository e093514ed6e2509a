"""The vocabularies of the configuration, written once: algorithms, schedules, backends and modes."""

ALGOS = ("sft", "dpo", "grpo", "gspo", "ppo")
RL_ALGOS = ("grpo", "gspo", "ppo")  # online RL: a rollout engine samples the batch
GROUP_ALGOS = ("grpo", "gspo")  # group advantages over several samples of one prompt (agentic rollout too)
TOKEN_CLIP_ALGOS = ("grpo", "ppo")  # the token-level clipped surrogate (GSPO clips whole sequences)
# --off-policy-correction: name -> its one line in --help (areno.rl.corrections defines them)
OFF_POLICY_CORRECTIONS = {
    "tis": "token-level truncated IS, weight min(r_t, --tis-cap)",
    "seq-tis": "sequence-level truncated IS, weight min(prod_t r_t, --tis-cap) on every token of the sequence",
    "mask": "masked IS, weight 1 or 0: tokens whose ratio, and sequences whose geometric-mean ratio, fall outside "
            "[--is-mask-low, --is-mask-high] are dropped",
    "icepop": "IcePop two-sided token masking, weight r_t inside [--is-mask-low, --is-mask-high], 0 outside",
    "cispo": "CISPO's objective, -sg(clip(r_t, 1 - --clip-eps-low, 1 + --clip-eps-high)) A log pi (MiniMax-M1)",
}
SEQUENCE_CORRECTIONS = ("seq-tis", "mask")  # a token's weight depends on its whole sequence
LR_STYLES = ("constant", "linear", "cosine")
OFFLOAD_MODES = ("none", "cpu", "disk")
OPTIMIZER_STATES = ("fp32", "8bit")  # --optimizer-states: AdamW moments in fp32, or blockwise-quantised to 8 bits
ATTN_BACKENDS = ("flash", "native")
DTYPES = ("bfloat16", "float16", "float32")
ROLLOUT_DTYPES = ("bf16", "fp8")  # --rollout-dtype: the rollout engine's linear weights as trained, or blockwise FP8
KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype: the paged KV cache in the model's dtype, or E4M3 + scales
# --mamba-ssm-cache-dtype (vLLM's flag): the hybrids' delta-rule state pool as the checkpoint's config.json asks
# (mamba_ssm_dtype; fp32 where it does not), in fp32 (the trainer's precision) or in bf16
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
ROUTING_REPLAY = ("auto", "on", "off")
TRAIN_CUDA_GRAPHS = ("auto", "on", "off")
WANDB_MODES = ("online", "offline")
# areno serve --tool-call-format: "auto" (by the checkpoint's model_type) or a format of areno.engine.tool_calls
TOOL_CALL_FORMATS = ("auto", "qwen3", "qwen3_coder", "gemma4", "harmony", "deepseek_v3", "llama3_json", "kimi_k2")
