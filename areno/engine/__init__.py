"""The inference engine: paged KV cache, continuous batching, CUDA-graph decode, TP workers (rollout and serve)."""
