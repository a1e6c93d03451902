"""CUDA C++ kernels built just in time (sources in sgl_ext/csrc)."""
