"""Mixture-of-experts feed-forward: the layer and its routers, the grouped-matmul kernels, expert
parallelism, shared experts, per-family variants and MXFP4-packed experts."""
