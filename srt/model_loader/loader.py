"""Build a model from a ModelConfig and fill its weights (safetensors or dummy), plus tokenizer.

- `load_format="auto"` / `"safetensors"`: `model.safetensors`, or shards listed in
  `model.safetensors.index.json` (every listed file must exist), or every `*.safetensors` file.
- `"pt"`: `pytorch_model*.bin` (loaded with `weights_only=True`).
- `"dummy"`: seeded random weights with a small std (norm weights near 1), no files read.
Tensors are routed through the model's `load_weights` (which packs q/k/v, gate/up, ...); every
model parameter must be covered. Missing or malformed files raise errors naming the file.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from srt.configs.load_config import LOAD_FORMATS
from srt.configs.model_config import ModelConfig
from srt.layers.mxfp4 import dummy_mxfp4
from srt.models.registry import get_model_class

SAFE_INDEX = "model.safetensors.index.json"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def safetensors_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (sharded via the index, or all)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    index = os.path.join(path, SAFE_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed safetensors index {index}: {e!r}") from e
        out = [os.path.join(path, name) for name in files]
        for file in out:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"shard {file} listed in {index} is missing")
        return out
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights (or {SAFE_INDEX}) in {path}")
    return files


def iterate_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of every file."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read safetensors file {file}: {e}") from e


def iterate_pt(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"no pytorch_model*.bin weights in {path}")
    for file in files:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 (torch raises many types for bad pickles)
            raise ValueError(f"cannot read weights file {file}: {e}") from e
        yield from state.items()


def full_parameter_shapes(
    cls: type[nn.Module], config: ModelConfig, model_impl: str = "srt"
) -> list[tuple[str, tuple]]:
    """(name, shape) of every parameter of the TP-1 model (a meta-device build: no memory)."""
    with torch.device("meta"):
        if model_impl == "sglang":
            from srt.compat.sglang_model import build_sglang_model

            ref = build_sglang_model(cls, config)
        else:
            ref = cls(config)
    return [(n, tuple(p.shape)) for n, p in ref.named_parameters()]


def load_full_weights(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load TP-1-shaped tensors named like the model's parameters through their weight loaders
    (shard_id None), each keeping its TP rank's part."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in named:
            p = params[name]
            loader = getattr(p, "weight_loader", None)
            if loader is None:
                if p.shape != w.shape:
                    raise ValueError(f"{name}: shape {tuple(w.shape)} != {tuple(p.shape)}")
                p.copy_(w)
            else:
                loader(p, w)


def dummy_tensor(name: str, shape: tuple, generator: torch.Generator, std: float) -> torch.Tensor:
    """N(0, std) float32 on the generator's device (norm weights 1 + N(0, std))."""
    w = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
    w *= std
    if len(shape) == 1 and name.endswith("norm.weight"):
        w += 1.0
    return w


def init_dummy_weights(
    model: nn.Module,
    seed: int = 0,
    std: float = 0.02,
    full_shapes: list[tuple[str, tuple]] | None = None,
    on_device: bool = False,
) -> None:
    """Seeded N(0, std) weights (norm weights 1 + N(0, std)).

    By default one CPU generator draws every tensor in parameter order, so every device gets the
    same numbers. `on_device` draws tensor i on the parameters' device from a generator seeded
    `seed + i` (fast for billions of numbers; the values then depend on the device).
    Packed MXFP4 expert tensors (uint8) get random valid E2M1 bytes and scales instead.
    With `full_shapes` (a TP > 1 model: `full_parameter_shapes`), the full TP-1 tensors are drawn
    in the same order and each rank keeps its shard, so every TP size gets the same model.
    """
    # Packed MXFP4 experts (uint8 E2M1 pairs and E8M0 scales, kept packed on CUDA) get random
    # valid bytes on their own device, per rank; every other tensor is drawn as below.
    packed = {n: p for n, p in model.named_parameters() if p.dtype == torch.uint8}
    with torch.no_grad():
        for i, (name, p) in enumerate(packed.items()):
            g = torch.Generator(device=p.device).manual_seed(seed + 7919 + i)
            p.copy_(dummy_mxfp4(tuple(p.shape), g, is_scale=name.endswith("_scale")))
    shapes = full_shapes or [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    shapes = [(n, shape) for n, shape in shapes if n not in packed]
    dev = next(model.parameters()).device
    cpu_gen = torch.Generator().manual_seed(seed)

    def draw(i: int, name: str, shape: tuple) -> torch.Tensor:
        gen = torch.Generator(device=dev).manual_seed(seed + i) if on_device else cpu_gen
        return dummy_tensor(name, shape, gen, std)

    load_full_weights(model, ((n, draw(i, n, shape)) for i, (n, shape) in enumerate(shapes)))


def get_model(
    config: ModelConfig,
    load_format: str = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
    dummy_on_device: bool = False,
    model_impl: str = "srt",
) -> nn.Module:
    """Instantiate the registry's class for `config` on `device` in `config.dtype`, load weights.

    Parameters
    ----------
    config : ModelConfig (its `path` is the checkpoint directory unless load_format="dummy").
    load_format : "auto", "safetensors", "pt" or "dummy".
    device : where parameters live.
    seed : seed of the dummy weights.
    tp_rank, tp_size : this rank's tensor-parallel position (its shard of every parallel layer).
    dummy_on_device : draw dummy weights on `device` (see `init_dummy_weights`).
    model_impl : "srt" (srt's model files) or "sglang" (a registered SGLang model file, built
        and loaded by `srt.compat.sglang_model`).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    cls = get_model_class(config.architecture, model_impl)
    sglang = model_impl == "sglang"
    with _default_dtype(config.dtype), torch.device(device):
        if sglang:
            from srt.compat.sglang_model import build_sglang_model

            model = build_sglang_model(cls, config, tp_rank, tp_size)
        else:
            model = cls(config, tp_rank=tp_rank, tp_size=tp_size)
    if load_format == "dummy":
        # TP > 1: draw the full tensors and shard them (the same model at every TP size).
        full = full_parameter_shapes(cls, config) if tp_size > 1 else None
        init_dummy_weights(model, seed, full_shapes=full, on_device=dummy_on_device)
    else:
        if config.path is None:
            raise ValueError("config has no checkpoint path; use load_format='dummy'")
        if load_format == "pt":
            weights = iterate_pt(config.path)
        else:
            weights = iterate_safetensors(safetensors_files(config.path))
        if sglang:
            from srt.compat.sglang_model import load_sglang_weights

            loaded = load_sglang_weights(model, weights)
        else:
            loaded = model.load_weights(weights)  # type: ignore[operator]
        missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
        if missing:
            raise ValueError(
                f"checkpoint {config.path} lacks {len(missing)} parameter(s), e.g. {missing[:5]}"
            )
    post_load = getattr(model, "post_load_weights", None)
    if post_load is not None:
        post_load()
    return model.eval()


def load_model(
    path: str | None = None,
    load_format: str = "auto",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
    config: ModelConfig | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Convenience: ModelConfig.from_hf(path) (or the tiny config) + get_model."""
    if config is None:
        if path is None:
            from srt.configs.tiny import tiny_llama_config

            config = ModelConfig.from_hf(tiny_llama_config(), dtype=dtype)
            load_format = "dummy"
        else:
            config = ModelConfig.from_hf(path, dtype=dtype)
    return get_model(config, load_format, device, seed), config


def load_tokenizer(path: str | None):
    """transformers.AutoTokenizer from a local checkpoint directory (or a Hub id, resolved to its
    cached snapshot), or None if it has none."""
    if path is None:
        return None
    if not os.path.isdir(path):
        from srt.model_loader.hub import looks_like_hub_id, resolve_model_path

        if not looks_like_hub_id(path):
            return None
        path = resolve_model_path(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot load the tokenizer in {path}: {e}") from e
