"""Opt-in C++ kernels for XLA:CPU (`model.attention = "cpu_kernel"`), compiled on first use.

`attention`: causal attention as two fused XLA FFI custom calls; `build`: the per-user compile cache
they load from (owner, mode and SHA-256 checked before loading).
"""
