"""`ServeConfig`: the flags of `areno serve` (the OpenAI-compatible server over one rollout session)."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

from dataclasses import dataclass
from typing import Optional

from areno.config.constants import (
    ATTN_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    MAMBA_SSM_CACHE_DTYPES,
    ROLLOUT_DTYPES,
    TOOL_CALL_FORMATS,
)
from areno.config.env import env_value
from areno.config.fields import (
    ConfigError,
    check_choice,
    check_media_limits,
    check_memory,
    check_non_negative,
    check_range,
    check_sizes,
    memory_amount,
    opt,
)
from areno.config.multimodal import IMAGE_BYTES_HELP, IMAGE_PIXELS_HELP, IMAGES_HELP
from areno.config.rollout import MAMBA_SSM_HELP, SPEC_GATE_HELP, SPECULATIVE_HELP, check_speculative, spec_gate


@dataclass
class ServeConfig:
    """`areno serve`: the OpenAI-compatible server over one rollout session."""

    model_path: Optional[str] = opt(None, "model: a Hugging Face repo id or a local folder (required)", "basic",
                                    metavar="PATH")
    world_size: int = opt(1, "worker ranks (one process per GPU)", "basic")
    tp_size: int = opt(1, "tensor-parallel size; --world-size must be divisible by it", "basic")
    dtype: Optional[str] = opt(None, "parameter/compute dtype", "basic", choices=DTYPES,
                               default_help="bfloat16 on GPU; float32 on a CPU without bfloat16 support")
    seed: int = opt(0, "base seed for requests that give none", "basic")
    host: str = opt("127.0.0.1", "address to listen on", "server", metavar="ADDR")
    port: int = opt(8000, "port to listen on (0 = any free port)", "server")
    api_key: Optional[str] = opt(None, "require this bearer token on every request (also read from ARENO_API_KEY, "
                                 "which keeps it out of the process list)", "server", metavar="KEY", secret=True)
    served_model_name: Optional[str] = opt(None, "model name reported by /v1/models and accepted in requests",
                                           "server", metavar="NAME", default_help="the --model-path")
    max_model_len: Optional[int] = opt(None, "maximum prompt + completion tokens per request", "server",
                                       default_help="the model's context length")
    max_request_bytes: int = opt(32 << 20, "largest request body accepted, in bytes (a larger one gets HTTP 413)",
                                 "server")
    read_timeout_s: float = opt(30.0, "seconds a client has to send a request's headers, then its body, from their "
                                "first byte (0 = no limit); a slower connection is closed", "server")
    max_connections: Optional[int] = opt(None, "connections open at once; the next one gets HTTP 503 and is closed",
                                         "server", default_help="three quarters of the file-descriptor limit")
    tool_call_format: str = opt(
        "auto", "how tool calls are read from the model's answers (OpenAI tool_calls): auto picks the checkpoint's "
        "family's own format by its model_type (qwen3 where it has none)", "server", choices=TOOL_CALL_FORMATS)
    lora_modules: Optional[list[str]] = opt(
        None, "LoRA adapters to serve (vLLM's flag): name=path (a PEFT adapter folder) or JSON "
        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}', several after one flag; a request's model "
        "picks one (the base stays servable by its own name); POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "change them at run time", "server", nargs="+", type=str, metavar="NAME=PATH")
    max_loras: Optional[int] = opt(None, "LoRA adapter slots (adapters loaded at once; requests for different "
                                   "adapters share each engine step); set alone, the slots wait for "
                                   "/v1/load_lora_adapter", "server", default_help="the number of --lora-modules")
    max_lora_rank: int = opt(16, "highest LoRA rank a slot holds (lower ranks zero-padded)", "server")
    responses_store_max: int = opt(
        1000, "responses /v1/responses keeps for GET and previous_response_id (store: true); the oldest are dropped "
        "first, and each after an hour", "server")
    max_running_prompts: int = opt(32, "cap on active sequences in the continuous batch", "rollout")
    attn_backend: Optional[str] = opt(
        None, "attention implementation: flash where the model and GPU support it, native for compatibility",
        "rollout", choices=ATTN_BACKENDS, default_help="the setup recorded by scripts/install.sh")
    eager_decode: bool = opt(False, "disable CUDA-graph replay for decode", "rollout")
    rollout_dtype: str = opt(
        "bf16", "the served linear weights (attention, MLP, MoE experts; not embeddings, lm_head, norms, routers): "
        "bf16 as loaded, or fp8: quantised blockwise at load (E4M3, 128x128 blocks, DeepSeek-V3's layout; vLLM's fp8 "
        "quantization) and run by the FP8 GEMMs; with --tp-size each rank quantises its shard, which must lie on the "
        "128-block grid", "rollout", choices=ROLLOUT_DTYPES)
    kv_cache_dtype: str = opt(
        "auto", "the paged KV cache: auto, the model's dtype; or fp8: E4M3 with one fp32 scale per token and KV head, "
        "quantised on write and dequantised by the attention kernel (about twice the tokens in the same "
        "--kv-cache-memory; vLLM's --kv-cache-dtype fp8; not for MLA latent caches)", "rollout",
        choices=KV_CACHE_DTYPES)
    mamba_ssm_cache_dtype: str = opt("auto", MAMBA_SSM_HELP, "rollout", choices=MAMBA_SSM_CACHE_DTYPES)
    speculative_tokens: int = opt(0, SPECULATIVE_HELP, "rollout")
    speculative_disable_by_batch_size: Optional[str] = opt(None, SPEC_GATE_HELP, "rollout", metavar="auto|N|off",
                                                           default_help="auto")
    engine_thread: bool = opt(
        False, "run the engine in a thread of the HTTP process instead of its own engine-core process (slower under "
        "load: the HTTP path and the engine share one interpreter lock; a --world-size == --tp-size > 1 server "
        "always runs its engine on TP rank 0)", "server")
    kv_cache_memory: Optional[float] = opt(
        None, "KV-cache budget: a fraction of free GPU memory (0.9) or a size (40GiB)", "memory",
        type=memory_amount, metavar="AMOUNT", default_help="the runtime decides")
    max_image_bytes: int = opt(20 << 20, IMAGE_BYTES_HELP, "multimodal")
    max_image_pixels: int = opt(50_000_000, IMAGE_PIXELS_HELP, "multimodal")
    max_images_per_prompt: int = opt(64, IMAGES_HELP, "multimodal")
    max_request_pixels: int = opt(
        50_000_000, "decoded pixels one request's images may hold in all (a larger request gets HTTP 400); the "
        "server also decodes at most this many at once and twice this many a second", "multimodal")
    decode_progress_interval_s: float = opt(
        0.0, "report decode throughput, active sequences and graph replay every N seconds (0 = off)",
        "observability")
    verbose: bool = opt(False, "print the resolved configuration to stdout before serving", "observability")

    def __post_init__(self):
        if self.api_key is None:
            self.api_key = env_value("ARENO_API_KEY") or None  # the flag wins; the variable stays out of `ps`
        if not self.model_path:
            raise ConfigError("--model-path", "is required (a Hugging Face repo id or a local folder)")
        check_sizes(self, ("world_size", "tp_size", "max_running_prompts", "max_model_len", "max_request_bytes",
                           "max_connections", "max_request_pixels", "responses_store_max"))
        if self.world_size % self.tp_size:
            raise ConfigError("--world-size", f"{self.world_size} is not divisible by --tp-size {self.tp_size}")
        check_choice("--attn-backend", self.attn_backend, ATTN_BACKENDS, optional=True)
        check_choice("--dtype", self.dtype, DTYPES, optional=True)
        check_choice("--tool-call-format", self.tool_call_format, TOOL_CALL_FORMATS)
        check_choice("--rollout-dtype", self.rollout_dtype, ROLLOUT_DTYPES)
        check_choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("--mamba-ssm-cache-dtype", self.mamba_ssm_cache_dtype, MAMBA_SSM_CACHE_DTYPES)
        if self.rollout_dtype == "fp8" and self.lora_enabled:
            raise ConfigError("--rollout-dtype", "fp8 with LoRA adapters (--lora-modules, --max-loras) is not built "
                                                 "yet")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError("--port", f"must be in [0, 65535], got {self.port!r}")
        if not self.host:
            raise ConfigError("--host", "must not be empty")
        check_memory("--kv-cache-memory", self.kv_cache_memory)
        check_non_negative("--decode-progress-interval-s", self.decode_progress_interval_s)
        check_non_negative("--read-timeout-s", self.read_timeout_s)
        check_range("--read-timeout-s", self.read_timeout_s, 0, 86400)  # a number of seconds (not nan or inf)
        check_media_limits(self)
        self._check_lora()
        check_speculative(self.speculative_tokens, {"--kv-cache-dtype fp8": self.kv_cache_dtype == "fp8",
                                                    "LoRA slots (--lora-modules / --max-loras)": self.lora_enabled})
        spec_gate(self.speculative_disable_by_batch_size)
        if self.speculative_disable_by_batch_size is not None and not self.speculative_tokens:
            raise ConfigError("--speculative-disable-by-batch-size", "applies only with --speculative-tokens > 0")

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_modules) or bool(self.max_loras)

    def lora_engine_kwargs(self) -> dict:
        """``build_engine``'s LoRA arguments: the slots and the adapters to load at start ({} without LoRA); and
        ``speculative_tokens`` and its gate when it is on."""
        if not self.lora_enabled:
            if not self.speculative_tokens:
                return {}
            return {"speculative_tokens": self.speculative_tokens,
                    "speculative_disable_by_batch_size": self.speculative_disable_by_batch_size}
        modules = {a["name"]: a["path"] for a in self.lora_adapters()}
        return {"max_loras": self.max_loras or len(modules), "max_lora_rank": self.max_lora_rank,
                "lora_modules": modules}

    def lora_adapters(self) -> list[dict]:
        """--lora-modules as ``[{"name", "path", "base_model_name"}]`` (``ConfigError`` naming the flag)."""
        return [lora_module(v, self.served_model_name or str(self.model_path).rstrip("/"))
                for v in self.lora_modules or ()]

    def _check_lora(self) -> None:
        check_sizes(self, ("max_loras", "max_lora_rank"))
        if not self.lora_enabled:
            if self.max_lora_rank != 16:
                raise ConfigError("--max-lora-rank", "applies only with --lora-modules or --max-loras (no LoRA slots "
                                  "otherwise)")
            return
        if self.tp_size > 1:
            raise ConfigError("--lora-modules" if self.lora_modules else "--max-loras",
                              "serving LoRA adapters with --tp-size > 1 is not built yet (adapters sharded with "
                              "their layers)")
        adapters = self.lora_adapters()
        names = [a["name"] for a in adapters]
        if len(set(names)) != len(names):
            raise ConfigError("--lora-modules", f"an adapter name is given twice: {names}")
        if self.max_loras is not None and len(names) > self.max_loras:
            raise ConfigError("--max-loras", f"{self.max_loras} slots cannot hold the {len(names)} --lora-modules")


def lora_module(value, base: str) -> dict:
    """One --lora-modules entry: ``name=path`` or vLLM's JSON form."""
    import json

    text = str(value).strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("--lora-modules", f"{text!r} is not JSON: {exc}") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(
                entry.get("path"), str) or set(entry) - {"name", "path", "base_model_name"}:
            raise ConfigError("--lora-modules", f"{text!r}: the JSON form has the string keys name, path and "
                              "optionally base_model_name")
        name, path, parent = entry["name"], entry["path"], entry.get("base_model_name") or base
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ConfigError("--lora-modules", f"{text!r} is not name=path")
        parent = base
    if not name.strip() or not path.strip():
        raise ConfigError("--lora-modules", f"{text!r}: the name and the path must not be empty")
    if name == base:
        raise ConfigError("--lora-modules", f"{name!r} is the base model's name (the base stays servable by it)")
    return {"name": name, "path": path, "base_model_name": parent}
