"""Resolve a Hugging Face Hub id (``meta-llama/Llama-3.2-1B``) to a local checkpoint folder.

A `model_path` that is a local directory is used as is. Otherwise, when it looks like a Hub id,
`huggingface_hub` (if installed) first looks in its local cache (no network), then, unless
``HF_HUB_OFFLINE=1``, downloads the config, tokenizer and weight files. Every failure raises
one-line errors that name the id: not installed, offline and not cached, not found, gated.
"""

from __future__ import annotations

import functools
import os
import re

from srt import settings

# What a checkpoint needs: configs and tokenizer files, safetensors weights, sentencepiece models,
# merges/vocab text files and chat templates. No *.bin / *.pth (we read safetensors).
HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(path: str) -> bool:
    """True for ``owner/name`` strings that are not paths on this machine."""
    return bool(_HUB_ID.match(path)) and ".." not in path and not os.path.exists(path)


@functools.lru_cache(maxsize=16)
def resolve_model_path(path: str, name: str = "model path") -> str:
    """The local directory of ``path``: itself, or the Hub snapshot it names.

    Parameters
    ----------
    path : a local checkpoint directory or a Hub id ``owner/name``.
    name : what the messages call it (a command line passes its flag, ``--model-path``).

    Returns
    -------
    str : a local directory holding ``config.json`` (for a Hub id: its cached snapshot).

    Raises
    ------
    FileNotFoundError : no such directory and not a Hub id, or the Hub cannot provide it
        (offline and not cached, no such repository, huggingface_hub not installed).
    NotADirectoryError : ``path`` is a file.
    PermissionError : a gated or private repository without access.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise NotADirectoryError(f"{name} is a file, not a checkpoint directory ({path})")
    if not looks_like_hub_id(path):
        raise FileNotFoundError(f"{name}: no such directory ({path})")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{name} is neither a local directory nor resolvable as a Hub id: "
            f"pip install huggingface_hub to download it ({path})"
        ) from None
    allow_patterns = list(HUB_ALLOW_PATTERNS)
    try:
        return snapshot_download(path, local_files_only=True, allow_patterns=allow_patterns)
    except Exception as e:  # noqa: BLE001 - any cache miss falls through to the download
        cached_error = e
    if settings.get().hf_hub_offline:
        raise FileNotFoundError(
            f"{name} is not a local directory and the Hub id is not in the local cache while "
            f"HF_HUB_OFFLINE=1 ({path})"
        ) from cached_error
    try:
        return snapshot_download(path, allow_patterns=allow_patterns)
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many types; classify by name
        raise _hub_error(path, name, e) from e


def _hub_error(path: str, name: str, e: Exception) -> OSError:
    """A one-line error for a failed Hub download: starts with `name` (the flag), ends with the
    id, and says what went wrong in words (huggingface_hub's many error types, by name)."""
    kind = type(e).__name__
    if kind == "GatedRepoError":
        return PermissionError(
            f"{name} is a gated Hub repository: accept its licence and log in "
            f"(hf auth login) ({path})"
        )
    if kind in ("RepositoryNotFoundError", "RevisionNotFoundError"):
        return FileNotFoundError(
            f"{name} is not a local directory and no such Hub repository (or it is "
            f"private) ({path})"
        )
    if kind in ("LocalEntryNotFoundError", "OfflineModeIsEnabled") or isinstance(e, OSError):
        return FileNotFoundError(
            f"{name} is not a local directory and the Hub cannot be reached (offline?) to "
            f"download it ({path})"
        )
    detail = " ".join(str(e).split())[:200]
    return FileNotFoundError(f"{name}: cannot download the Hub id: {kind}: {detail} ({path})")


__all__ = ["HUB_ALLOW_PATTERNS", "looks_like_hub_id", "resolve_model_path"]
