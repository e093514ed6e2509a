"""Helpers only tests use: the CPU stand-ins for CUDA-graph capture (capture_guard) and replay (cpu_graph), and the
`areno train` command lines of the flag tests (flag_context)."""
