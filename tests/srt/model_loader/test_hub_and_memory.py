"""Hub ids resolve from the local cache without network; the weight-memory check and message."""

from __future__ import annotations

import json

import pytest
import torch

from srt import settings
from srt.model_loader.hub import looks_like_hub_id, resolve_model_path
from srt.model_loader.weight_memory import (
    NotEnoughMemoryError,
    WeightFootprint,
    check_weight_memory,
    describe_load,
)


def test_looks_like_hub_id(tmp_path):
    assert looks_like_hub_id("meta-llama/Llama-3.2-1B")
    for path in ("/abs/path", "a/b/c", "../x/y", "name", str(tmp_path)):
        assert not looks_like_hub_id(path)


def test_hub_id_from_local_cache_offline(tmp_path, monkeypatch):
    """A cached snapshot resolves with HF_HUB_OFFLINE=1 (nothing is downloaded)."""
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llm"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache), raising=False)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True, raising=False)
    resolve_model_path.cache_clear()
    with settings.override(hf_hub_offline=True):
        assert resolve_model_path("acme/tiny-llm") == str(snap)
        with pytest.raises(FileNotFoundError, match=r"HF_HUB_OFFLINE=1 \(acme/other\)"):
            resolve_model_path("acme/other")
    resolve_model_path.cache_clear()


@pytest.mark.parametrize(
    ("error_name", "words"),
    [
        ("LocalEntryNotFoundError", "cannot be reached"),
        ("OfflineModeIsEnabled", "cannot be reached"),
        ("RepositoryNotFoundError", "no such Hub repository"),
        ("GatedRepoError", "gated"),
        ("ConnectionError", "cannot be reached"),
        ("SomethingElse", "cannot download"),
    ],
)
def test_hub_download_errors_name_the_flag_and_the_id(monkeypatch, error_name, words):
    """Without the id in the cache and without a network, each failure is one line that
    starts with the flag and ends with the id, never with the exception's class name."""
    hf = pytest.importorskip("huggingface_hub")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    base = OSError if error_name == "ConnectionError" else Exception
    err = type(error_name, (base,), {})

    def fail(repo_id, **kwargs):
        raise err("boom")

    monkeypatch.setattr(hf, "snapshot_download", fail)
    resolve_model_path.cache_clear()
    try:
        with settings.override(hf_hub_offline=False), pytest.raises(OSError) as e:
            resolve_model_path("acme/missing-model", name="--model-path")
    finally:
        resolve_model_path.cache_clear()
    msg = str(e.value)
    assert msg.startswith("--model-path") and msg.endswith("(acme/missing-model)"), msg
    assert words in msg and "\n" not in msg
    if error_name != "SomethingElse":
        assert error_name not in msg


def test_local_paths(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match=r"is a file"):
        resolve_model_path(str(f), name="--model-path")
    with pytest.raises(FileNotFoundError, match=r"^--model-path: no such directory \(/no/x/y\)$"):
        resolve_model_path("/no/x/y", name="--model-path")


def test_weight_memory_check(monkeypatch):
    from srt.model_loader import weight_memory

    fp = WeightFootprint(8_030_261_248, 8_030_261_248 * 4, torch.float32)
    monkeypatch.setattr(weight_memory, "available_memory", lambda d: 16 << 30)
    with pytest.raises(NotEnoughMemoryError, match=r"\(29.9 GiB needed, 16.0 GiB available\)$"):
        check_weight_memory(fp, torch.device("cpu"), "llama")
    small = WeightFootprint(1000, 4000, torch.float32)
    check_weight_memory(small, torch.device("cpu"), "tiny")  # fits: no error
    monkeypatch.setattr(weight_memory, "available_memory", lambda d: None)
    check_weight_memory(fp, torch.device("cpu"), "llama")  # unknown: no check
    line = describe_load("/ckpt", "LlamaForCausalLM", fp, torch.device("cpu"), "auto")
    assert line == (
        "loading /ckpt (LlamaForCausalLM): 8.03 B parameters, 29.92 GiB in float32 on cpu, "
        "auto weights"
    )
