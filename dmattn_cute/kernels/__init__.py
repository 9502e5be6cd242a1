"""CuTe DSL kernels. Per family a kernel module with its frozen spec (the compile key: fwd.py,
bwd_pre.py, bwd.py) and a torch-side launcher (fwd_launch.py, bwd_launch.py); shared by all:
spec.py (dtype names, operand facts, offline-compile arguments), launch.py (tensor views,
operand specs, scalars), config.py (tile tables, shared memory) and the device helpers."""
