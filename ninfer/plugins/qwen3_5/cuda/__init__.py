"""The CUDA runners of the Qwen model: captured decode, verify and MTP draft graphs on the Triton kernels."""
