"""Kernels: ``reference/`` holds the pure-torch twins (the CPU path and the oracle), ``triton/`` the GPU kernels."""
