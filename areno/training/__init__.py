"""Generic training, free of any RL algorithm: packed batches, the trainer, CUDA-graph steps, the optimizer,
schedules, checkpoints, the run folder, metrics, data rows, user plugins and multimodal towers."""
