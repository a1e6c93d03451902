"""Names SGLang's kernel package (`sglang.kernels.jit`) gives its model files (`utils.py`)."""
