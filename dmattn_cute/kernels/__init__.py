"""CuTe DSL kernels: one kernel family per module, each with its frozen spec (compile key)."""
