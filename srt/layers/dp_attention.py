"""Data-parallel attention (SGLang's `dp_attention`): not part of srt, so never enabled."""

from __future__ import annotations


def is_dp_attention_enabled() -> bool:
    return False
