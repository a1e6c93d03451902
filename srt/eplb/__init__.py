"""Expert-parallel load balancing (EPLB): not part of srt; see the submodules for the names
SGLang's MoE model files use."""
