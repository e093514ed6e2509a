"""The `rollout` section of `areno train`: devices and split mode, sampling, agentic rollout and the engine."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

from dataclasses import dataclass
from typing import Optional

from areno.config.constants import (
    ATTN_BACKENDS,
    GROUP_ALGOS,
    KV_CACHE_DTYPES,
    MAMBA_SSM_CACHE_DTYPES,
    RL_ALGOS,
    ROLLOUT_DTYPES,
)
from areno.config.fields import (
    ConfigError,
    check_choice,
    check_non_negative,
    check_positive,
    check_sizes,
    device_list,
    flag_name,
    opt,
)
from areno.config.sampling import check_sampling

SPECULATIVE_HELP = ("MTP speculative decoding: draft tokens per sequence and step from the model's multi-token-"
                    "prediction layers (Qwen3.5, DeepSeek-V3, Ling 3), verified in one forward by exact rejection "
                    "sampling, so the tokens are distributed as without it (0 = off; needs a model with MTP layers; "
                    "under CUDA graphs a step verifying K drafts per sequence replays a graph per batch bucket)")


MAMBA_SSM_HELP = ("state pool of the hybrid models' linear-attention layers (Qwen3.5, Ling 3, Kimi Linear; vLLM's "
                  "flag): auto (default: the checkpoint config's mamba_ssm_dtype where it names float32 or bfloat16, "
                  "else float32, the trainer's precision), float32, or bfloat16 (half the memory and decode traffic; "
                  "rollout log-probs drift further from the trainer's); a named dtype is refused for a model without "
                  "such layers")


SPEC_GATE_HELP = ("speculative decoding's automatic gate (vLLM's speculative disable_by_batch_size): a step "
                  "speculates only while at most N sequences decode in it, and above that is a plain decode step "
                  "(verifying K + 1 positions a sequence costs up to (K + 1)x once the step is compute-bound); "
                  "auto: N follows the running accept length a (since the rollout started; a server's: since it was "
                  "last idle) on the device's roofline: "
                  "N = T (a - K mu) / (K + 1), T the tokens where a step turns compute-bound (dense bf16 FLOP/s over "
                  "memory bandwidth, times the model's weight bytes per FLOP of a token), mu a draft step's share of "
                  "the model's FLOPs; auto also keeps a step that prefills prompts plain unless its verify rows cost "
                  "less than the tokens they add would in the decode after it; 32 on a device without a roofline, "
                  "e.g. the CPU; off or 0: never gated")


def spec_gate(value) -> str | int:
    """``--speculative-disable-by-batch-size`` as the engine takes it: "auto" (also for None, not given) or N >= 0
    (0: never gated; "off" too); a ``ConfigError`` naming the flag otherwise."""
    if value is None or value == "auto":
        return "auto"
    if value == "off":
        return 0
    if not isinstance(value, bool) and isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise ConfigError("--speculative-disable-by-batch-size", f"takes auto, off or an integer N >= 0, got {value!r}")


def check_speculative(tokens: int, refused: dict) -> None:
    """``--speculative-tokens`` >= 0, and not with a setting it is not built for yet (``refused``: {setting: on?})."""
    check_non_negative("--speculative-tokens", tokens)
    for setting, on in refused.items():
        if tokens and on:
            raise ConfigError("--speculative-tokens", f"with {setting} is not built yet")


@dataclass
class RolloutSection:
    """`--help` group rollout (its checks read the basic section's algorithm and sizes)."""

    train_devices: Optional[list[int]] = opt(
        None, "GPU indices of the training ranks, e.g. 0..3 or 0,1,2,3 (one per rank: the world size is its length)",
        "rollout", type=device_list, metavar="IDS", default_help="GPUs 0..world size - 1")
    rollout_devices: Optional[list[int]] = opt(
        None, "GPU indices of a separate rollout partition, e.g. 4..7 (split mode: rollout engines run there and the "
        "policy is streamed to them after each optimizer step; needs --train-devices)", "rollout", type=device_list,
        metavar="IDS", default_help="off: rollout is colocated on the training ranks", algos=RL_ALGOS)
    rollout_tp_size: Optional[int] = opt(None, "tensor-parallel size of each rollout engine in split mode", "rollout",
                                         default_help="--tp-size", algos=RL_ALGOS, needs="split")
    max_context_len: Optional[int] = opt(
        None, "agentic rollout: tokens of a whole trajectory (prompt, turns, tool results)", "rollout",
        default_help="--max-prompt-tokens + --max-new-tokens", algos=GROUP_ALGOS, needs="agent")
    agent_timeout_s: float = opt(300.0, "agentic rollout: seconds one sample's agent may run before it is scored 0.0 "
                                 "as a failure (0 = no limit)", "rollout", algos=GROUP_ALGOS, needs="agent")
    train_tool_results: bool = opt(False, "agentic rollout: train on tool-result tokens too (by default only the "
                                   "sampled tokens are trained)", "rollout", algos=GROUP_ALGOS,
                                   needs="agent")
    policy_sync_bucket_mb: float = opt(64.0, "split mode: MiB per bucket of the policy streamed to the rollout "
                                       "engines", "rollout", algos=RL_ALGOS, needs="split")
    max_staleness: int = opt(
        0, "split mode: K >= 0 policy versions of lag allowed: 0 = on-policy (the rollout waits for the new policy); "
        "K > 0 = the rollouts of the next K steps run while this step trains, and a sample whose oldest token is more "
        "than K versions older than the trained policy is dropped (counted as stale_dropped)", "rollout",
        algos=RL_ALGOS, needs="split")
    partial_rollout: bool = opt(
        False, "split mode, --max-staleness >= 1: a generation in flight when new weights arrive continues under the "
        "new policy (the engine swaps the weights in place at a step boundary and drops its prefix cache); each token "
        "records the policy version that sampled it", "rollout", algos=RL_ALGOS, needs="async")
    partial_rollout_kv: str = opt(
        "keep", "--partial-rollout: the running sequences' K/V when the weights change: keep (computed under the old "
        "policy) or recompute (under the new one)", "rollout", choices=("keep", "recompute"), algos=RL_ALGOS,
        needs="partial")
    max_tail_steps: int = opt(
        0, "--partial-rollout: once half of a batch's prompt groups are done, the groups still decoding this many "
        "decode rounds later are cut into the next batch (they finish there) instead of stalling this step (0 = off)",
        "rollout", algos=RL_ALGOS, needs="partial")
    max_running_prompts: Optional[int] = opt(
        None, "cap on active rollout sequences (and their KV-cache demand)", "rollout",
        default_help="the whole rollout batch", needs="rollout")
    max_prompt_tokens: int = opt(1024, "a row whose prompt has more tokens is dropped, not truncated (counted in "
                                 "one warning at start); prompt + --max-new-tokens must fit the model's context",
                                 "rollout")
    max_new_tokens: int = opt(1024, "maximum generated tokens per completion", "rollout", needs="rollout")
    min_new_tokens: int = opt(0, "minimum generated tokens before EOS/stop may end a completion", "rollout",
                             needs="rollout")
    temperature: float = opt(1.0, "sampling temperature (0 = greedy)", "rollout", algos=RL_ALGOS)
    top_p: float = opt(1.0, "nucleus sampling threshold in (0, 1]", "rollout", algos=RL_ALGOS)
    top_k: int = opt(0, "top-k sampling (0 = off)", "rollout", algos=RL_ALGOS)
    min_p: float = opt(0.0, "min-p sampling in [0, 1]: drop tokens less likely than this times the most likely one "
                       "(after temperature; 0 = off)", "rollout", algos=RL_ALGOS)
    repetition_penalty: float = opt(
        1.0, "divide the positive logits (multiply the negative ones) of tokens already in the prompt or completion by "
        "this, before temperature (> 0; 1 = off); rollout log-probs are then those of the penalised distribution",
        "rollout", needs="rollout")
    presence_penalty: float = opt(0.0, "subtract this from the logits of tokens already in the completion, in [-2, 2]"
                                  " (0 = off)", "rollout", needs="rollout")
    frequency_penalty: float = opt(0.0, "subtract this times a token's count in the completion from its logit, in "
                                   "[-2, 2] (0 = off)", "rollout", needs="rollout")
    stop: Optional[list[str]] = opt(None, "stop string (repeat the flag for several)", "rollout", action="append",
                                    type=str, metavar="TEXT", needs="rollout")
    attn_backend: Optional[str] = opt(
        None, "attention implementation: flash where the model and GPU support it, native for compatibility",
        "rollout", choices=ATTN_BACKENDS, default_help="the setup recorded by scripts/install.sh")
    speculative_tokens: int = opt(0, SPECULATIVE_HELP + "; with --decode-steps 1", "rollout", needs="rollout")
    speculative_disable_by_batch_size: Optional[str] = opt(None, SPEC_GATE_HELP, "rollout", metavar="auto|N|off",
                                                           default_help="auto", needs="speculative")
    mtp_loss_weight: float = opt(
        0.0, "train the model's MTP (multi-token-prediction) layers, the --speculative-tokens draft, alongside the RL "
        "loss so they stay aligned with the moving policy: each microbatch adds W x their next-next-token "
        "cross-entropy on the policy's own sampled sequences (teacher forced from the detached hidden states: the "
        "policy's gradient and update are unchanged; same lr and AdamW, its own grad-norm clip); the trained layers "
        "reach the rollout engine with every policy sync and are saved under their Hub names (logs mtp_loss, "
        "mtp_accuracy; 0 = off; needs a model with MTP layers)", "rollout", algos=RL_ALGOS)
    eager_decode: bool = opt(False, "disable CUDA-graph replay for rollout decode", "rollout", needs="rollout")
    rollout_dtype: str = opt(
        "bf16", "the rollout engine's linear weights (attention, MLP, MoE experts; not embeddings, lm_head, norms, "
        "routers): bf16 as trained, or fp8: blockwise E4M3 copies (128x128 blocks, DeepSeek-V3's layout) quantised "
        "after each optimizer step and run by the FP8 GEMMs, the trainer staying bf16 (split mode streams the copies: "
        "about half the bytes; under TP each rank quantises its shard, which must lie on the 128-block grid); pair "
        "with --off-policy-correction tis", "rollout", choices=ROLLOUT_DTYPES,
        algos=RL_ALGOS)
    kv_cache_dtype: str = opt(
        "auto", "the rollout engine's paged KV cache: auto, the model's dtype; or fp8: E4M3 with one fp32 scale per "
        "token and KV head, quantised on write and dequantised by the attention kernel (about twice the tokens in "
        "the same --kv-cache-memory; not for MLA latent caches)", "rollout", choices=KV_CACHE_DTYPES,
        algos=RL_ALGOS)
    mamba_ssm_cache_dtype: str = opt("auto", MAMBA_SSM_HELP, "rollout", choices=MAMBA_SSM_CACHE_DTYPES,
                                     algos=RL_ALGOS)
    decode_steps: int = opt(8, "decode steps chained on the device between two scheduling rounds of the rollout "
                            "(one CUDA graph; a completion that stops early drops the surplus; on a GPU the next "
                            "chain is queued before the current one's tokens are read); 1 = every token",
                            "rollout", needs="rollout")

    @property
    def rollout_tp(self) -> int:
        """Each split-mode rollout engine's TP size (``--rollout-tp-size``, default ``--tp-size``)."""
        return self.rollout_tp_size or self.tp_size

    @property
    def split(self) -> bool:
        """Split mode: rollout engines on their own devices (``--rollout-devices``)."""
        return self.rollout_devices is not None

    def check_rollout(self):
        """The values and their combinations (where a flag applies at all is areno.config.applies' check)."""
        check_sizes(self, ("rollout_tp_size", "max_running_prompts", "max_prompt_tokens", "max_new_tokens"))
        check_choice("--attn-backend", self.attn_backend, ATTN_BACKENDS, optional=True)
        self._check_devices()
        self._check_staleness()
        self._check_agent()
        self._check_rollout_dtype()
        self._check_sampling()
        self._check_mtp()

    def _check_mtp(self):
        w = self.mtp_loss_weight
        if not (isinstance(w, (int, float)) and 0 <= w < float("inf")):
            raise ConfigError("--mtp-loss-weight", f"must be a finite number >= 0, got {w!r}")
        for given, what, why in ((self.lora_rank > 0, "--lora-rank > 0", "LoRA and QLoRA train an adapter, not the "
                                  "MTP layers"), (self.tp_size > 1, "--tp-size > 1", "the MTP layers train on one "
                                  "rank"), (self.rollout_dtype == "fp8", "--rollout-dtype fp8", "the draft's FP8 "
                                  "rollout is not built"), (self.train_cuda_graphs == "on", "--train-cuda-graphs on",
                                  "the MTP loss reads the eager forward's hidden states")):  # fmt: skip
            if w and given:
                raise ConfigError("--mtp-loss-weight", f"with {what} is not built yet ({why})")

    def _check_agent(self):
        if self.agent_fn is None:
            return
        if self.partial_rollout:
            raise ConfigError("--partial-rollout", "with --agent-fn is not built yet: the agents sample through the "
                              "engines' token service, which finishes every turn under one policy (a sync waits for "
                              "the episodes in flight); --max-staleness K alone sends agent batches ahead")
        check_positive("--max-context-len", self.max_context_len, optional=True)
        check_non_negative("--agent-timeout-s", self.agent_timeout_s)

    def _check_rollout_dtype(self):
        check_choice("--rollout-dtype", self.rollout_dtype, ROLLOUT_DTYPES)
        check_choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("--mamba-ssm-cache-dtype", self.mamba_ssm_cache_dtype, MAMBA_SSM_CACHE_DTYPES)
        if self.rollout_dtype != "fp8":
            return
        if self.lora_rank > 0:  # (under TP a shard off the 128-block grid is refused before launch: cli)
            raise ConfigError("--rollout-dtype", "fp8 with --lora-rank > 0 is not built yet (the adapter's forward "
                                                 "reads the bf16 base)")

    def _check_staleness(self):
        check_non_negative("--max-staleness", self.max_staleness)
        check_non_negative("--max-tail-steps", self.max_tail_steps)
        check_choice("--partial-rollout-kv", self.partial_rollout_kv, ("keep", "recompute"))
        if self.partial_rollout and self.drop_rollout_state:
            raise ConfigError("--partial-rollout", "keeps sequences in the engines across steps: it does not combine "
                              "with --drop-rollout-state, which frees the engines' KV cache after every rollout")

    def _check_devices(self):
        train, rollout = self.train_devices, self.rollout_devices
        if rollout is not None and train is None:
            raise ConfigError("--rollout-devices", "needs --train-devices too (split mode places both partitions)")
        if train is None:
            return
        for name, devices in (("--train-devices", train), ("--rollout-devices", rollout or [])):
            if len(set(devices)) != len(devices):
                raise ConfigError(name, f"lists a GPU twice: {devices}")
        if len(train) != self.world_size:
            raise ConfigError("--world-size", f"{self.world_size} conflicts with --train-devices, which lists "
                              f"{len(train)} GPUs (the world size is its length)")
        if rollout is None:
            return
        overlap = sorted(set(train) & set(rollout))
        if overlap:
            raise ConfigError("--rollout-devices", f"overlaps --train-devices on GPU {overlap} (the partitions must "
                              "be disjoint)")
        if len(rollout) % self.rollout_tp:
            raise ConfigError("--rollout-devices", f"lists {len(rollout)} GPUs, not divisible by --rollout-tp-size "
                              f"{self.rollout_tp}")
        if not self.policy_sync_bucket_mb > 0:
            raise ConfigError("--policy-sync-bucket-mb", f"must be > 0, got {self.policy_sync_bucket_mb}")

    def _check_sampling(self):
        check_sampling(self, flag_name)
        check_positive("--decode-steps", self.decode_steps)
        check_speculative(self.speculative_tokens, {"--decode-steps > 1": self.decode_steps > 1,
                                                    "--kv-cache-dtype fp8": self.kv_cache_dtype == "fp8"})
        spec_gate(self.speculative_disable_by_batch_size)
        if self.algo in GROUP_ALGOS and self.n_samples < 2:
            raise ConfigError("--n-samples", f"must be >= 2 for --algo {self.algo} (group advantages compare "
                              "several samples of one prompt)")


def normalize_devices(config) -> None:
    """--train-devices / --rollout-devices given as text or a list -> lists of ints (ConfigError naming the flag)."""
    for name in ("train_devices", "rollout_devices"):
        value = getattr(config, name)
        if value is not None:
            try:
                setattr(config, name, device_list(value))
            except ValueError as e:
                raise ConfigError(flag_name(name), str(e)) from None
