"""Triton kernels of sgl_ext (imported lazily: triton is optional on CPU)."""
