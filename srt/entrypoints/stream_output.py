"""Streamed outputs as the HTTP server sends them: cumulative (SGLang's default) or incremental.

SGLang's `/generate` stream sends, per chunk, the whole text and `output_ids` so far (a client
reads `text[len(prev):]`); with `--incremental-streaming-output` only what is new. OpenAI
streams always send the new text. `StreamAccumulator` gives both views of every chunk whatever
the engine yields: a chunk whose `output_ids` hold `meta_info["completion_tokens"]` ids is
cumulative, any other an increment (the two agree on a request's first chunk, where the ids so
far are the new ones). Every per-token list (`output_ids`, and any `output_*` list at the top
level or in `meta_info`, such as logprobs) is joined or sliced alike.
"""

from __future__ import annotations

import os
from typing import Any

_Path = tuple[str, ...]


def _token_lists(chunk: dict[str, Any]) -> dict[_Path, list]:
    """The per-token lists of a chunk by their path (("output_ids",), ("meta_info", ...))."""
    found: dict[_Path, list] = {}
    for key, value in chunk.items():
        if key.startswith("output_") and isinstance(value, list):
            found[(key,)] = value
    meta = chunk.get("meta_info")
    if isinstance(meta, dict):
        for key, value in meta.items():
            if key.startswith("output_") and isinstance(value, list):
                found[("meta_info", key)] = value
    return found


def _with(chunk: dict[str, Any], text: str | None, lists: dict[_Path, list]) -> dict[str, Any]:
    """A copy of `chunk` with `text` and the lists replaced (meta_info copied, not shared)."""
    out = dict(chunk)
    if isinstance(out.get("meta_info"), dict):
        out["meta_info"] = dict(out["meta_info"])
    if text is not None:
        out["text"] = text
    for path, value in lists.items():
        target = out
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return out


class StreamAccumulator:
    """One output's stream: feed each engine chunk to `add`, get (cumulative, incremental)."""

    def __init__(self) -> None:
        self.text = ""
        self.lists: dict[_Path, list] = {}

    @staticmethod
    def is_cumulative(chunk: dict[str, Any]) -> bool:
        ids = chunk.get("output_ids")
        total = (chunk.get("meta_info") or {}).get("completion_tokens")
        return isinstance(ids, list) and total is not None and len(ids) == total

    def add(self, chunk: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The chunk as the whole output so far and as what is new since the last call."""
        lists = _token_lists(chunk)
        cumulative = self.is_cumulative(chunk)
        full_lists: dict[_Path, list] = {}
        new_lists: dict[_Path, list] = {}
        for path, value in lists.items():
            before = self.lists.get(path, [])
            if cumulative:
                full_lists[path], new_lists[path] = list(value), list(value[len(before) :])
            else:
                full_lists[path], new_lists[path] = before + list(value), list(value)
        self.lists.update(full_lists)
        full_text = new_text = None
        if isinstance(chunk.get("text"), str):
            if cumulative:
                full_text = chunk["text"]
                common = len(os.path.commonprefix([self.text, full_text]))
                new_text = full_text[common:]
            else:
                new_text = chunk["text"]
                full_text = self.text + new_text
            self.text = full_text
        return _with(chunk, full_text, full_lists), _with(chunk, new_text, new_lists)


__all__ = ["StreamAccumulator"]
