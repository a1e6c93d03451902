"""ModelRunner: builds the model, KV pools, allocator and attention backend; runs forwards.

Follows SGLang's `model_runner.py`: `ModelRunner(server_args)` loads the model through the
registry and the loader, sizes the KV pool (explicit `max_total_tokens`, or the free GPU memory
times `mem_fraction_static`), builds the ReqToTokenPool / MHATokenToKVPool / allocator and the
attention backend, captures the decode CUDA graphs, and `forward(forward_batch)` returns the
next-token logits of every request.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, cast

import torch

from srt.configs.model_config import checkpoint_dtype
from srt.distributed import (
    get_tp_local_rank,
    get_tp_rank,
    get_tp_size,
    model_parallel_is_initialized,
    tensor_model_parallel_min_int,
)
from srt.layers.logits_processor import LogitsProcessorOutput, scored_all_logits
from srt.model_executor.forward_batch_info import ForwardBatch
from srt.sampling.greedy import GreedySampler, argmax_native
from srt.server_args import ServerArgs

if TYPE_CHECKING:
    from srt.mem_cache.memory_pool import MHATokenToKVPool
    from srt.mem_cache.swa_memory_pool import SWAKVPool
    from srt.model_executor.cuda_graph_runner import CudaGraphRunner

logger = logging.getLogger(__name__)

_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def runtime_dtype(name: str, device: torch.device, config_dtype: torch.dtype | None) -> torch.dtype:
    """The model dtype the runner uses for ServerArgs.dtype `name`; "auto" depends on the device:
    the checkpoint's half dtype on CUDA (bf16 if it is fp32), float32 on CPU."""
    if name != "auto":
        return checkpoint_dtype(name)
    if device.type != "cuda":
        return torch.float32
    if config_dtype in (torch.float16, torch.bfloat16):
        return config_dtype
    return torch.bfloat16


def kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV-cache dtype for ServerArgs.kv_cache_dtype ("auto" follows the model dtype)."""
    return dtype if name == "auto" else _KV_DTYPES[name]


class ModelRunner:
    """Owns the model and its KV cache; runs EXTEND and DECODE forwards.

    Parameters
    ----------
    server_args : ServerArgs (device-dependent defaults are resolved here).
    model_config : optional pre-built ModelConfig (else built from model_path / the tiny config).
    model : optional already-loaded model to reuse (with its model_config), e.g. to compare the
        fused and unfused paths on the same weights without loading them twice.

    Attributes
    ----------
    model, model_config, device, dtype, kv_dtype, page_size, max_total_num_tokens,
    max_running_requests, req_to_token_pool, token_to_kv_pool (MHATokenToKVPool, or SWAKVPool
    for models with sliding-window layers unless disable_hybrid_swa_memory),
    token_to_kv_pool_allocator, kv_memory_report (KVMemoryReport: bytes per token, tokens that
    fit), attn_backend, cascade_attn (decode reads shared prefixes once per group: the backend
    can, the prefix cache is on and `disable_cascade_attn` is not set), cuda_graph_runner (None
    when disabled or capture failed).
    """

    def __init__(
        self,
        server_args: ServerArgs,
        model_config: Any = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        self.server_args = args = server_args.resolved()
        self.tp_size = args.tp_size
        self.tp_rank = self._check_tp()
        assert args.device is not None  # resolved() picks one
        self.device = torch.device(args.device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but no CUDA device is available")
            if self.device.index is None:
                idx = get_tp_local_rank() if self.tp_size > 1 else torch.cuda.current_device()
                self.device = torch.device("cuda", idx)
            torch.cuda.set_device(self.device)
        self.page_size = args.page_size
        torch.manual_seed(args.random_seed)
        self.model_config = model_config if model_config is not None else self._model_config()
        self.dtype = runtime_dtype(
            args.dtype, self.device, getattr(self.model_config, "dtype", None)
        )
        self.kv_dtype = kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        if model is None:
            model = self._load_model()
        elif model_config is None:
            raise ValueError("passing model needs its model_config too")
        self.model = model.requires_grad_(False).eval()
        self.context_len = self._context_len()
        self._fit_rope_tables()
        self._init_memory_pool()
        self.attn_backend = self._init_attention_backend()
        self.cascade_attn = self.attn_backend.supports_cascade and not (
            args.disable_radix_cache or args.disable_cascade_attn
        )
        # greedy tokens on the GPU (graph replays run its kernel; eager calls launch it)
        self.greedy = (
            GreedySampler(self.max_running_requests, self.device)
            if self.device.type == "cuda"
            else None
        )
        self.cuda_graph_runner: CudaGraphRunner | None = None
        if not args.disable_cuda_graph and self.device.type == "cuda":
            self._init_cuda_graphs()
        if self.device.type == "cuda":  # eager decode sizes, split-KV extends: compiled now
            self._warmup_eager()

    # ---- construction ----
    def _check_tp(self) -> int:
        """This process's TP rank; TP > 1 needs the TP group (init_distributed_environment)."""
        if self.tp_size == 1:
            return 0
        if not model_parallel_is_initialized() or get_tp_size() != self.tp_size:
            raise RuntimeError(
                f"tp_size={self.tp_size} needs a TP group of that size: run under torchrun or "
                "through srt.Engine, or call srt.distributed.init_distributed_environment first"
            )
        return get_tp_rank()

    def _model_config(self) -> Any:
        from srt.model_executor.model_builder import build_model_config

        return build_model_config(self.server_args)

    def _load_model(self) -> torch.nn.Module:
        from srt.model_executor.model_builder import build_model

        return build_model(
            self.model_config, self.server_args, self.dtype, self.device, self.tp_rank, self.tp_size
        )

    def _kv_shape(self) -> tuple[int, int, int, int]:
        """(layers, kv_heads, head_dim, v_head_dim) of the KV cache."""
        from srt.model_executor.model_builder import kv_cache_shape

        return kv_cache_shape(self.model_config, self.tp_size)

    def _context_len(self) -> int:
        """Longest sequence served: context_length, else the model config's context."""
        return self.server_args.context_length or int(
            getattr(self.model_config, "context_len", None)
            or self.model_config.max_position_embeddings
        )

    def _fit_rope_tables(self) -> None:
        """Every rope table covers positions 0 .. context_len - 1, or construction fails.

        A shorter table is grown with the same formula (computed once here, before any graph
        capture); a variant that cannot grow raises ValueError naming both numbers. Positions
        are never clamped silently.
        """
        from srt.layers.rotary_embedding import RotaryEmbedding

        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.ensure_cos_sin_cache_length(self.context_len)

    def _profile_kv_budget(self) -> int:
        """Bytes left for the KV cache in mem_fraction_static of the GPU after the weights."""
        free, total = torch.cuda.mem_get_info(self.device)
        rest = free - total * (1.0 - self.server_args.mem_fraction_static)
        if rest <= 0:
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB; raise mem_fraction_static or set max_total_tokens"
            )
        return int(rest)

    def _swa_layer_ids(self) -> tuple[list[int], list[int], int] | None:
        """(window layer ids, full layer ids, largest window-left) when the hybrid pool is used:
        the model has both kinds of layers and disable_hybrid_swa_memory is off."""
        cfg = self.model_config
        if self.server_args.disable_hybrid_swa_memory or not hasattr(cfg, "get_window_left"):
            return None
        windows = [int(cfg.get_window_left(i)) for i in range(int(cfg.num_hidden_layers))]
        swa = [i for i, w in enumerate(windows) if w > 0]  # RadixAttention: 0 means full
        full = [i for i, w in enumerate(windows) if w <= 0]
        if not swa or not full:
            return None
        return swa, full, max(windows)

    def _init_memory_pool(self) -> None:
        from srt.mem_cache.kv_memory import (
            KVCacheShape,
            default_request_rows,
            kv_memory_report,
            swa_pool_size,
        )
        from srt.mem_cache.memory_pool import ReqToTokenPool

        args, ps = self.server_args, self.page_size
        layers, heads, head_dim, v_head_dim = self._kv_shape()
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        swa_layers = self._swa_layer_ids()
        n_swa = len(swa_layers[0]) if swa_layers else 0
        shape = KVCacheShape(layers - n_swa, n_swa, heads, head_dim, v_head_dim, elem)
        rows = args.max_running_requests or 256
        swa_tokens = 0
        if swa_layers:
            swa_tokens = swa_pool_size(swa_layers[2], ps, rows, self.context_len)
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        elif self.device.type == "cuda":
            budget = self._profile_kv_budget() - (swa_tokens + ps) * shape.swa_bytes_per_token
            tokens = max(0, budget // shape.full_bytes_per_token - ps)
        else:
            tokens = args.cpu_max_total_tokens
        if args.max_running_requests is None and swa_layers is None and self.device.type == "cuda":
            rows = default_request_rows(tokens, self.context_len)
        if args.max_total_tokens is None:
            # More than every request row at full context can never be used.
            tokens = min(tokens, rows * (self.context_len + ps))
        tokens = tensor_model_parallel_min_int(tokens, self.device)  # same pool on every rank
        tokens = tokens // ps * ps
        if tokens < ps:
            raise ValueError(f"KV pool of {tokens} tokens is smaller than one page ({ps})")
        swa_tokens = min(swa_tokens, tokens)  # the window never needs more slots than tokens
        self.max_total_num_tokens = tokens
        self.max_running_requests = args.max_running_requests or max(1, min(rows, tokens // ps))
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests,
            self.context_len + 4,
            self.device,
            enable_swa=swa_layers is not None,
        )
        if swa_layers is None:
            self._init_uniform_pool(tokens, layers, heads, head_dim, v_head_dim)
        else:
            self._init_swa_pool(tokens, swa_tokens, swa_layers, heads, head_dim, v_head_dim)
        self.kv_memory_report = kv_memory_report(shape, ps, tokens, swa_tokens)
        logger.info(
            "%s, %s, %d request rows",
            self.kv_memory_report.describe(),
            self.kv_dtype,
            self.max_running_requests,
        )

    def _init_uniform_pool(
        self, tokens: int, layers: int, heads: int, head_dim: int, v_head_dim: int
    ) -> None:
        from srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from srt.mem_cache.memory_pool import MHATokenToKVPool

        ps = self.page_size
        alt_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        pool = MHATokenToKVPool(
            tokens,
            ps,
            self.kv_dtype,
            heads,
            head_dim,
            layers,
            self.device,
            v_head_dim=v_head_dim,
            alt_stream=alt_stream,
        )
        self.token_to_kv_pool: MHATokenToKVPool | SWAKVPool = pool
        self.token_to_kv_pool_allocator: Any
        if ps == 1:
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
                tokens, self.device, kvcache=pool, scrub_on_alloc=True
            )
        else:
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
                tokens, ps, self.device, kvcache=pool, scrub_on_alloc=True
            )

    def _init_swa_pool(
        self,
        tokens: int,
        swa_tokens: int,
        swa_layers: tuple[list[int], list[int], int],
        heads: int,
        head_dim: int,
        v_head_dim: int,
    ) -> None:
        from srt.mem_cache.swa_allocator import SWATokenToKVPoolAllocator
        from srt.mem_cache.swa_memory_pool import SWAKVPool

        swa_ids, full_ids, window = swa_layers
        alt_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        pool = SWAKVPool(
            tokens,
            swa_tokens,
            self.page_size,
            self.kv_dtype,
            heads,
            head_dim,
            swa_ids,
            full_ids,
            window,
            self.device,
            v_head_dim=v_head_dim,
            alt_stream=alt_stream,
        )
        self.token_to_kv_pool = pool
        self.token_to_kv_pool_allocator = SWATokenToKVPoolAllocator(
            tokens,
            swa_tokens,
            self.page_size,
            self.device,
            pool,
            scrub_on_alloc=True,
        )

    def _init_attention_backend(self) -> Any:
        name = self.server_args.attention_backend
        if name == "torch_native":
            from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            return TorchNativeAttnBackend(self.req_to_token_pool, self.device)
        if name == "triton":
            try:
                from srt.layers.attention.triton_backend import TritonAttnBackend
            except ImportError as e:
                warnings.warn(
                    f"Triton attention backend unavailable ({e}); using torch_native",
                    RuntimeWarning,
                    stacklevel=2,
                )
            else:
                return TritonAttnBackend(self.req_to_token_pool, self.device)
            from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            return TorchNativeAttnBackend(self.req_to_token_pool, self.device)
        raise ValueError(f"unknown attention_backend {name!r}")

    def _init_cuda_graphs(self) -> None:
        from srt.model_executor.cuda_graph_runner import CudaGraphRunner

        try:
            self.cuda_graph_runner = CudaGraphRunner(self)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
            warnings.warn(
                f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding runs eagerly. "
                "Pass disable_cuda_graph=True to silence this.",
                RuntimeWarning,
                stacklevel=2,
            )
            self.cuda_graph_runner = None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _warmup_eager(self) -> None:
        from srt.model_executor.decode_warmup import (
            eager_decode_sizes,
            warmup_eager_decode,
            warmup_extend_splits,
        )

        graphs = self.cuda_graph_runner
        first = 1 if graphs is None else graphs.max_bs + 1
        with torch.inference_mode():
            sizes = eager_decode_sizes(first, self.max_running_requests)
            warmup_eager_decode(self, sizes, self.cascade_attn)
            warmup_extend_splits(self)

    # ---- forward ----
    @property
    def is_capturing(self) -> bool:
        """True while the CUDA-graph runner captures (the flag lives on that runner)."""
        return self.cuda_graph_runner is not None and self.cuda_graph_runner.is_capturing

    def _run_model(self, fb: ForwardBatch) -> Any:
        """The model's output on an initialised batch: a LogitsProcessorOutput or [T|B, V]."""
        translate = getattr(fb.token_to_kv_pool, "translate_loc_from_full_to_swa", None)
        if translate is not None and fb.out_cache_loc_swa is None:
            # hybrid pool: window slots of the new tokens, on device (a decode batch from
            # ScheduleBatch already carries them: no gather, 5 launches fewer a step)
            fb.out_cache_loc_swa = translate(fb.out_cache_loc)  # int64 [T], -1 = none
        return self.model(fb.input_ids, fb.positions, fb)

    def forward_with_input_logprobs(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """An EXTEND forward that also scores the prompt tokens (`return_logprob` and its fields
        set on the batch; see srt/layers/logprob_processor.py). Eager, like every prefill.

        Returns
        -------
        LogitsProcessorOutput: next_token_logits float [B, V] and input_logprobs.
        """
        fb = forward_batch
        if not fb.forward_mode.is_extend() or not fb.return_logprob:
            raise ValueError("forward_with_input_logprobs needs an EXTEND batch, return_logprob")
        with torch.inference_mode():
            self.attn_backend.init_forward_metadata(fb)
            out = self._run_model(fb)
            if isinstance(out, LogitsProcessorOutput) and out.input_logprobs is not None:
                return out
            # a model without a LogitsProcessor returns [T, V] logits: score those rows here
            return scored_all_logits(out, fb)

    def model_forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The model on an already-initialised batch (what CUDA graphs capture).

        Returns
        -------
        float [B, V]: logits of each request's last new token.
        """
        fb = forward_batch
        with torch.inference_mode():
            out = self._run_model(fb)
            logits = getattr(out, "next_token_logits", out)  # LogitsProcessorOutput or tensor
            if fb.forward_mode.is_extend() and logits.shape[0] != fb.batch_size:
                # [T, V] per-token logits: keep each request's last token.
                assert fb.extend_start_loc is not None and fb.extend_seq_lens is not None
                last = fb.extend_start_loc.long() + fb.extend_seq_lens.long() - 1  # [B]
                logits = logits.index_select(0, last)
        return logits

    def forward(self, forward_batch: ForwardBatch, use_cuda_graph: bool = True) -> torch.Tensor:
        """Run one EXTEND or DECODE batch; decode replays a CUDA graph when one fits.

        Parameters
        ----------
        forward_batch : the batch.
        use_cuda_graph : False forces the eager path (benchmarks and tests compare the two).

        Returns
        -------
        float [B, V] next-token logits (for a graph replay: a view valid until the next one).
        """
        fb = forward_batch
        graphs = self.cuda_graph_runner if use_cuda_graph else None
        if graphs is not None and graphs.can_run(fb):
            return graphs.replay(fb)
        with torch.inference_mode():
            self.attn_backend.init_forward_metadata(fb)
        return self.model_forward(fb)

    def decode_static_inputs(self, batch_size: int, rows: int) -> torch.Tensor | None:
        """Where a decode block of batch_size requests (int64 [rows, batch_size]) is written so
        that its graph replay copies nothing: the decode graphs' static inputs, or None (no
        graphs, or the batch does not fit them)."""
        graphs = self.cuda_graph_runner
        return None if graphs is None else graphs.static_inputs(batch_size, rows)

    def _greedy_kernel_ids(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The greedy kernel's device ids of logits (launched, unless the graph replay that
        returned logits ran it), or None where the kernel does not take them (CPU, more rows
        than its buffers, another dtype or layout)."""
        g = self.greedy
        if (
            g is None
            or logits.device != g.device
            or logits.dim() != 2
            or logits.shape[0] > g.max_rows
            or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or logits.stride(1) != 1
        ):
            return None
        return g.ids[: logits.shape[0]] if logits is g.pending else g.launch(logits)

    def greedy_ids(self, logits: torch.Tensor) -> list[int]:
        """`torch.argmax(logits, -1).tolist()`, the greedy next tokens, with the least work after
        the forward: a graph replay's logits have their argmax computed and stored in pinned
        host memory inside the graph (this waits for the replay and reads it); other CUDA logits
        take the same kernel in one launch.

        Parameters
        ----------
        logits : float [B, V], what `forward` returned (a graph replay's: before the next one).

        Returns
        -------
        B ints: each row's first index of its largest value (NaN above every number).
        """
        if self._greedy_kernel_ids(logits) is None:
            return argmax_native(logits).tolist()
        torch.cuda.current_stream(logits.device).synchronize()
        return cast(GreedySampler, self.greedy).tokens(logits.shape[0])

    def greedy_ids_device(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [B], the greedy next tokens of logits on logits' device, without waiting (the
        overlapped decode feeds them to the next step): the kernel's buffer, valid until its
        next launch or graph replay (copy them before), or torch.argmax's result."""
        ids = self._greedy_kernel_ids(logits)
        return argmax_native(logits) if ids is None else ids
