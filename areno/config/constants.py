"""The vocabularies of the configuration, written once: algorithms, schedules, backends and modes."""

ALGOS = ("sft", "dpo", "grpo", "gspo", "ppo")
RL_ALGOS = ("grpo", "gspo", "ppo")  # online RL: a rollout engine samples the batch
GROUP_ALGOS = ("grpo", "gspo")  # group advantages over several samples of one prompt (agentic rollout too)
TOKEN_CLIP_ALGOS = ("grpo", "ppo")  # the token-level clipped surrogate (GSPO clips whole sequences)
LR_STYLES = ("constant", "linear", "cosine")
OFFLOAD_MODES = ("none", "cpu", "disk")
ATTN_BACKENDS = ("flash", "native")
DTYPES = ("bfloat16", "float16", "float32")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
ROUTING_REPLAY = ("auto", "on", "off")
TRAIN_CUDA_GRAPHS = ("auto", "on", "off")
WANDB_MODES = ("online", "offline")
# areno serve --tool-call-format: "auto" (by the checkpoint's model_type) or a format of areno.engine.tool_calls
TOOL_CALL_FORMATS = ("auto", "qwen3", "qwen3_coder", "gemma4", "harmony", "deepseek_v3", "llama3_json", "kimi_k2")
