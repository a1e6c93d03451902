"""Compatibility with other projects' model code: `sglang.py` runs SGLang's own model files on
srt through an import remap; `sglang_model.py` builds and loads such models."""
