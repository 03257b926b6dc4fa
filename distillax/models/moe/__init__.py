"""Mixture-of-experts feed-forward: the layer and its routers, the grouped-matmul kernels, expert
parallelism, shared experts, per-family variants, MXFP4-packed experts, and what the config's
MoE fields may hold (config_checks.py)."""
