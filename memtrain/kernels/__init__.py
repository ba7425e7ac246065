"""Triton kernels, each beside a PyTorch reference with the same signature and a dispatcher that
picks the kernel on CUDA and the reference elsewhere. Imports only torch (and triton lazily)."""
