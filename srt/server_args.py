"""ServerArgs: the frozen configuration of one model runner / offline engine (SGLang's names)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from srt.configs.load_config import LOAD_FORMATS

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("torch_native", "triton")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MODEL_IMPLS = ("srt", "sglang")  # srt.models.registry.MODEL_IMPLS
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "fp32", "fp16", "bf16")


def default_device() -> str:
    """ "cuda" when a GPU is visible, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class ServerArgs:
    """Everything the model runner and the engine are built from.

    Names follow SGLang's `ServerArgs`. `None` means "pick a default for this device/model"
    (resolved by `resolved()`), so a `ServerArgs()` with no arguments runs the embedded tiny
    model on whatever device is present.

    Attributes
    ----------
    model_path : HF checkpoint directory; None builds the embedded tiny config (random weights).
    load_format : "auto" (read the checkpoint), "dummy" (random weights, seeded), ...
    device : "cuda" or "cpu" (None: cuda if available).
    dtype : activation/weight dtype, "auto" takes the checkpoint's (float32 on CPU).
    kv_cache_dtype : "auto" (= dtype), "fp8_e4m3" or "fp8_e5m2".
    page_size : KV-cache page size in tokens (>= 1).
    attention_backend : "torch_native" or "triton" (None: triton on CUDA, torch_native on CPU).
    enable_fused_rope_kv : write K/V to the cache inside the RoPE kernel (the point of sgl_ext).
    disable_cuda_graph : run decode eagerly (always true on CPU).
    cuda_graph_max_bs : largest captured decode batch; cuda_graph_bs overrides the bucket list.
    max_total_tokens : KV-pool size in tokens; None sizes it from mem_fraction_static (CUDA) or
        cpu_max_total_tokens (CPU).
    max_running_requests : concurrent requests (rows of the req-to-token pool). None: on a GPU
        with a uniform pool SGLang's rule (512 per context's worth of KV slots, within
        [2048, 4096]), else 256; never more than the pool's pages.
    json_model_override_args : JSON dict merged into the HF config (used by the bench presets).
    allow_auto_truncate : a request whose prompt + max_new_tokens exceeds the context length is
        cut to fit (reported in its meta_info["truncation"]) instead of rejected.
    disable_hybrid_swa_memory : keep every layer's KV for every token (one uniform pool) even
        for models with sliding-window layers; by default those layers get their own, smaller
        pool (`SWAKVPool`) that holds only the tokens inside the window.
    disable_overlap_schedule : read every decode step's tokens back before preparing the next
        one. By default (SGLang's overlap schedule) greedy decode steps are prepared and
        launched while the previous step still runs, its tokens fed from the device.
    disable_radix_cache : compute every prompt from its first token. By default (SGLang's
        RadixAttention) the prefix cache keeps finished requests' KV pages in a radix tree and
        a new request computes only what follows its longest cached prefix (on the hybrid
        sliding-window pool too: `SWARadixCache`).
    disable_cascade_attn : read every decoding request's whole KV. By default a decode step
        reads a prefix that several running requests share in the prefix cache once for all of
        them (the Triton backend's cascade decode, in CUDA graphs of 8 or more requests too;
        vLLM's name).
    chunked_prefill_size : prompt tokens of one request computed per step: a longer prompt is
        prefilled over several steps while the running requests keep decoding between its
        chunks. None: SGLang's default for the device's memory (2048 under 20 GiB, 4096 under
        60 GiB, 8192 under 160 GiB, else 16384; 4096 without a GPU); -1 turns it off.
    decode_chunked_prefill_size : the chunk instead while other requests decode (at most
        chunked_prefill_size), so that a long prompt's chunks do not stall their every token:
        each decode step waits for one chunk. None: DEFAULT_DECODE_CHUNK (256); -1: no cap
        (whole chunks of chunked_prefill_size between two decode steps).
    enable_cache_report : OpenAI responses' usage also has
        `prompt_tokens_details.cached_tokens` (the prompt tokens taken from the prefix cache).
    incremental_streaming_output : streamed chunks carry only the ids and text added since the
        previous chunk. By default (SGLang's) every chunk has the whole output so far.
    log_level : level of the "srt" loggers ("debug" ... "critical"); None leaves logging alone.
    tp_size : tensor-parallel ranks (one process each; NCCL on CUDA, gloo on CPU).
    dist_init_addr : "host:port" of the TP rendezvous for Engine-spawned ranks (None: a free
        local port); torchrun-launched ranks use its env:// instead.
    dist_timeout : seconds a rank waits for the others (collectives, start-up, each request)
        before the engine fails instead of hanging.
    model_impl : "srt" (srt's own model files) or "sglang": SGLang's own model file
        `model_file`, imported unmodified through `srt.compat.sglang`'s import remap, serves the
        checkpoint's architecture (TP 1).
    model_file : path of that SGLang model file (e.g. SGLang's llama.py); files it imports
        (`sglang.srt.models.qwen2` for qwen3.py) are looked up beside it.
    """

    model_path: str | None = None
    tokenizer_path: str | None = None
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    device: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    page_size: int = 1
    attention_backend: str | None = None
    enable_fused_rope_kv: bool = True
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 64
    cuda_graph_bs: tuple[int, ...] | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    cpu_max_total_tokens: int = 16384
    max_running_requests: int | None = None
    context_length: int | None = None
    random_seed: int = 0
    tp_size: int = 1
    dist_init_addr: str | None = None
    dist_timeout: float = 600.0
    json_model_override_args: str = "{}"
    allow_auto_truncate: bool = False
    disable_hybrid_swa_memory: bool = False
    disable_overlap_schedule: bool = False
    disable_radix_cache: bool = False
    disable_cascade_attn: bool = False
    chunked_prefill_size: int | None = None
    decode_chunked_prefill_size: int | None = None
    enable_cache_report: bool = False
    incremental_streaming_output: bool = False
    log_level: str | None = None
    model_impl: str = "srt"
    model_file: str | None = None

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {self.page_size!r}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must be >= page_size, got {self.max_total_tokens}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}"
            )
        if self.context_length is not None and (
            isinstance(self.context_length, bool)
            or not isinstance(self.context_length, int)
            or self.context_length < 1
        ):
            raise ValueError(
                f"context_length must be an int >= 1 (or None: the model's), "
                f"got {self.context_length!r}"
            )
        for name in ("chunked_prefill_size", "decode_chunked_prefill_size"):
            chunk = getattr(self, name)
            if chunk is not None and (
                isinstance(chunk, bool) or not isinstance(chunk, int) or (chunk < 1 and chunk != -1)
            ):
                raise ValueError(f"{name} must be an int >= 1, or -1 (off), got {chunk!r}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be > 0 seconds, got {self.dist_timeout}")
        if self.log_level is not None and str(self.log_level).lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        self._check_model_impl()
        try:
            overrides = json.loads(self.json_model_override_args)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_model_override_args is not valid JSON: {e}") from e
        if not isinstance(overrides, dict):
            raise ValueError("json_model_override_args must encode a JSON object")

    def _check_model_impl(self) -> None:
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.model_impl == "sglang" and self.model_file is None:
            raise ValueError("model_impl 'sglang' needs model_file (an SGLang model file)")
        if self.model_impl == "sglang" and self.tp_size != 1:
            raise ValueError(
                f"tensor parallelism (tp_size={self.tp_size}) with SGLang model files is not "
                "supported: use model_impl 'srt' or tp_size 1"
            )
        if self.model_file is not None:
            if self.model_impl != "sglang":
                raise ValueError("model_file is an SGLang model file: it needs model_impl 'sglang'")
            if not os.path.isfile(self.model_file) or not self.model_file.endswith(".py"):
                raise ValueError(f"model_file is not a .py file: {self.model_file!r}")

    @property
    def model_overrides(self) -> dict[str, Any]:
        """json_model_override_args decoded."""
        return json.loads(self.json_model_override_args)

    def resolved(self) -> ServerArgs:
        """A copy with the device-dependent defaults (device, attention backend, graphs) filled.

        Raises ValueError for a device or backend this machine cannot run (checked here, before
        any weight is loaded, so a server never starts only to fail every request).
        """
        device = self.device or default_device()
        on_cuda = device.startswith("cuda")
        backend = self.attention_backend or ("triton" if on_cuda else "torch_native")
        check_device_backends(device, backend)
        chunk, decode_chunk = self.chunked_prefill_size, self.decode_chunked_prefill_size
        return dataclasses.replace(
            self,
            device=device,
            attention_backend=backend,
            disable_cuda_graph=self.disable_cuda_graph or not on_cuda,
            chunked_prefill_size=default_chunked_prefill_size(device) if chunk is None else chunk,
            decode_chunked_prefill_size=DEFAULT_DECODE_CHUNK
            if decode_chunk is None
            else decode_chunk,
        )


# Prompt tokens of a chunked request per step while others decode. A Llama-3-8B decode step of
# 32 requests on an H100 takes ~7 ms; a chunk of 256 tokens after up to 32K cached keys adds
# ~7-20 ms (its linear layers stay near the weight-read floor below ~300 tokens; its attention,
# split-KV, grows with the keys), against ~50 ms for 512 tokens and ~400 ms for 8192.
DEFAULT_DECODE_CHUNK = 256


def default_chunked_prefill_size(device: str) -> int:
    """SGLang's chunked_prefill_size for a device, by its memory (GiB): < 20: 2048, < 60:
    4096, < 160: 8192, else 16384; 4096 without a GPU."""
    if not device.startswith("cuda"):
        return 4096
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    gib = torch.cuda.get_device_properties(index).total_memory / 2**30
    for limit, size in ((20, 2048), (60, 4096), (160, 8192)):
        if gib < limit:
            return size
    return 16384


def check_device_backends(device: str, attention_backend: str) -> None:
    """Raise ValueError unless this machine can run `attention_backend` and the sgl_ext backend
    (SGL_EXT_BACKEND) on `device`: CUDA must be visible for "cuda", and Triton kernels on the
    CPU need the interpreter (TRITON_INTERPRET=1)."""
    import torch

    from sgl_ext import settings

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} but no CUDA device is visible: use device 'cpu'")
        return
    interpret = settings.get().interpret
    if attention_backend == "triton" and not interpret:
        raise ValueError(
            f"attention_backend 'triton' cannot run on device {device!r}: use 'torch_native' "
            "(or set TRITON_INTERPRET=1 to run Triton in its slow CPU interpreter)"
        )
    if settings.get().backend == "triton" and not interpret:
        raise ValueError(
            f"SGL_EXT_BACKEND=triton cannot run on device {device!r}: unset it or use 'native' "
            "(or set TRITON_INTERPRET=1 to run Triton in its slow CPU interpreter)"
        )
