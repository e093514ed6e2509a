"""One rank of a tensor-parallel ``areno serve`` (``--world-size`` == ``--tp-size`` > 1), started by torch's elastic
launcher: rank 0 runs the HTTP server and the scheduler; every other rank loads its shard and executes the steps
rank 0 broadcasts until the server closes the session."""

import json
import sys
from datetime import timedelta

from areno.config import ServeConfig
from areno.config.env import env_value
from areno.serve.server import TP_CONFIG_ENV, run_server


def main() -> int:
    raw = env_value(TP_CONFIG_ENV)
    if not raw:
        print(f"areno.serve.tp_worker: {TP_CONFIG_ENV} is not set; start servers with `areno serve`", file=sys.stderr)
        return 2
    config = ServeConfig(**json.loads(raw))
    from areno.distributed import parallel

    # a follower waits on rank 0 for as long as the server idles
    parallel.init_distributed(tp_size=config.tp_size, timeout=timedelta(days=30))
    if parallel.tp_rank() == 0:
        return run_server(config)
    import signal

    from areno.engine.build import build_engine

    # the launcher forwards SIGTERM to every rank: a follower stops when rank 0 closes the session, not before
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)

    engine, _ = build_engine(
        config.model_path, tp_size=config.tp_size, max_running=config.max_running_prompts,
        max_model_len=config.max_model_len, eager_decode=config.eager_decode, attn_backend=config.attn_backend,
        dtype=config.dtype, seed=config.seed, kv_cache_memory=config.kv_cache_memory,
        kv_cache_dtype=config.kv_cache_dtype, rollout_dtype=config.rollout_dtype,  # rank 0's cache and weights
        mamba_ssm_cache_dtype=config.mamba_ssm_cache_dtype,  # and its state pools (the same bytes to plan)
        # the MTP draft's shard and cache layer, for the speculative steps rank 0 plans
        speculative_tokens=config.speculative_tokens,
        speculative_disable_by_batch_size=config.speculative_disable_by_batch_size,
    )
    engine.follow()
    return 0


if __name__ == "__main__":
    sys.exit(main())
