"""Helpers only tests use: the CPU stand-ins for CUDA-graph capture (capture_guard) and replay (cpu_graph), the
`areno train` command lines of the flag tests (flag_context), and the per-family tests' shared pieces (families: TP
workers, arithmetic data, routing capture checks)."""
