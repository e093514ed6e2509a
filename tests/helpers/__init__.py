"""Helpers only tests use: the CPU stand-ins for CUDA-graph capture (capture_guard) and replay (cpu_graph)."""
