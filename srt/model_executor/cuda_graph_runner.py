"""CudaGraphRunner: decode forwards captured as CUDA graphs, one per batch-size bucket.

Follows SGLang's `cuda_graph_runner.py`. Graphs are captured largest batch first and share one
memory pool. A decode batch of B requests replays the graph of the smallest bucket >= B; the
padding rows (B .. bucket-1) get token 0, position 0, the backend's seq-len fill value, request
row 0 and KV slot 0 (the pool's padding slot, which no request ever reads), so they never touch
a real request's cache.

With the prefix cache, buckets of at least CASCADE_MIN_BS get a second graph that reads the
batch's shared prefixes once per group (the backend's cascade decode, docs/design.md 3.2); a
batch with `shared_prefixes` replays it.

The capture-mode flag (`is_capturing`) lives on this runner and is reset in `try/finally`; the
KV pool's stream overlap (V written on an alternate stream) is switched on only while capturing.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any, Protocol

import torch

from srt.mem_cache.write_check import check_padding_writes, kv_write_checks_enabled
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

# Smallest decode bucket that gets a cascade graph too (smaller batches share little).
CASCADE_MIN_BS = 8

if TYPE_CHECKING:
    from srt.layers.attention.base_attn_backend import AttentionBackend
    from srt.sampling.greedy import GreedySampler
    from srt.server_args import ServerArgs


class GraphModelRunner(Protocol):
    """What CudaGraphRunner uses of its model runner (`model_runner.ModelRunner` is one):
    declared here, so the graph runner does not import the runner that builds it."""

    @property
    def server_args(self) -> ServerArgs:
        """cuda_graph_max_bs, cuda_graph_bs, enable_fused_rope_kv."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def max_running_requests(self) -> int: ...

    @property
    def attn_backend(self) -> AttentionBackend: ...

    @property
    def cascade_attn(self) -> bool:
        """Whether decode reads shared prefixes once per group (the cascade graphs)."""
        ...

    @property
    def req_to_token_pool(self) -> Any: ...

    @property
    def token_to_kv_pool(self) -> Any: ...

    @property
    def page_size(self) -> int: ...

    @property
    def greedy(self) -> GreedySampler | None:
        """The greedy argmax each graph ends with (None: none captured)."""
        ...

    def model_forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """[bs, V] logits of a decode batch (what a graph captures)."""
        ...


def get_batch_sizes_to_capture(max_bs: int, bs_list: tuple[int, ...] | None = None) -> list[int]:
    """Buckets 1, 2, 4, 8, then steps of 8 up to max_bs (max_bs itself always included).

    `bs_list` overrides the list (still clipped to max_bs). Returned ascending, unique.
    """
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    if bs_list is not None:
        sizes = {int(b) for b in bs_list if 1 <= int(b) <= max_bs}
        if not sizes:
            raise ValueError(f"cuda_graph_bs {bs_list} has no batch size in [1, {max_bs}]")
    else:
        sizes = {b for b in (1, 2, 4) if b <= max_bs} | set(range(8, max_bs + 1, 8))
    sizes.add(max(sizes) if bs_list is not None else max_bs)
    return sorted(sizes)


def _decode_fields(fb: ForwardBatch, rows: int) -> tuple[torch.Tensor | None, ...]:
    """The batch's decode inputs in the order of the graphs' static block (rows 5 or 6)."""
    fields = (fb.input_ids, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc, fb.positions)
    return fields + (fb.out_cache_loc_swa,) if rows == 6 else fields


def _decode_block(fb: ForwardBatch, bs: int, rows: int = 5) -> torch.Tensor | None:
    """fb's decode_inputs block where it holds the batch's decode inputs as its rows (int64
    [rows, bs], rows contiguous, each field a [bs] tensor at its row; rows 6 adds the window
    slots of a hybrid pool): one copy then moves them all. None otherwise, e.g. for a batch
    whose fields were replaced after it was built (a copy per field then). Runs before every
    replay's launch (~3 µs on the dev CPU)."""
    block = fb.decode_inputs
    if block is None or block.shape != (rows, bs) or block.dtype != torch.int64:
        return None
    row_stride, col_stride = block.stride()
    if col_stride != 1:
        return None
    base, row_bytes = block.data_ptr(), row_stride * 8
    for i, f in enumerate(_decode_fields(fb, rows)):
        if f is None or f.data_ptr() != base + i * row_bytes or f.shape != (bs,):
            return None
    return block


class CudaGraphRunner:
    """Captures and replays decode graphs for a ModelRunner.

    Parameters
    ----------
    model_runner : the ModelRunner (what of it is used: `GraphModelRunner`); its
        `model_forward(forward_batch)` is what gets captured, its pools and attention backend
        are shared.
    """

    def __init__(self, model_runner: GraphModelRunner) -> None:
        self.model_runner = model_runner
        args = model_runner.server_args
        self.device = model_runner.device
        max_bs = min(args.cuda_graph_max_bs, model_runner.max_running_requests)
        self.capture_bs = get_batch_sizes_to_capture(max_bs, args.cuda_graph_bs)
        self.max_bs = self.capture_bs[-1]
        self.enable_fused_rope_kv = args.enable_fused_rope_kv
        self.is_capturing = False
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graph_memory_pool: Any = None
        backend = model_runner.attn_backend
        # Cascade decode (shared prefixes read once per group) gets a second graph per bucket of
        # at least CASCADE_MIN_BS.
        cascade = model_runner.cascade_attn
        self.cascade_bs = [b for b in self.capture_bs if b >= CASCADE_MIN_BS] if cascade else []
        self.cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.cascade_outputs: dict[int, torch.Tensor] = {}
        self.seq_len_fill_value = int(backend.get_cuda_graph_seq_len_fill_value())
        # Static inputs, [max_bs] each, the rows of one block in ForwardBatch.decode_inputs's
        # order; replays copy the real batch into their first columns (one copy for a batch
        # that carries decode_inputs). out_cache_loc 0: the padding slot. A hybrid pool adds
        # the window slots (out_cache_loc_swa; 0 is the window pool's padding slot too), so the
        # graph does not gather them from the full -> window mapping.
        pool = model_runner.token_to_kv_pool
        self.hybrid = hasattr(pool, "translate_loc_from_full_to_swa")
        rows = 6 if self.hybrid else 5
        self.decode_inputs = torch.zeros(rows, self.max_bs, dtype=torch.int64, device=self.device)
        (
            self.input_ids,
            self.req_pool_indices,
            self.seq_lens,
            self.out_cache_loc,
            self.positions,
        ) = self.decode_inputs[:5].unbind(0)
        self.out_cache_loc_swa = self.decode_inputs[5] if self.hybrid else None
        self.seq_lens.fill_(self.seq_len_fill_value)
        self._padding = self.decode_inputs.clone()  # what padding columns hold
        self.seq_lens_cpu = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64)
        # per bucket, the views a replay hands the backend (made once: no slicing per replay)
        self._views = {
            bs: (self.req_pool_indices[:bs], self.seq_lens[:bs], self.seq_lens_cpu[:bs])
            for bs in self.capture_bs
        }
        backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        self.capture()

    # ---- capture ----
    def _forward_batch(self, bs: int, seq_lens_sum: int) -> ForwardBatch:
        r = self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_sum=seq_lens_sum,
            positions=self.positions[:bs],
            out_cache_loc_swa=None
            if self.out_cache_loc_swa is None
            else self.out_cache_loc_swa[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs],
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
            enable_fused_rope_kv=self.enable_fused_rope_kv,
        )

    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        pool = self.model_runner.token_to_kv_pool
        self.is_capturing = True
        pool.set_stream_overlap(True)
        try:
            stream = capture_stream(self.device)
            for bs in reversed(self.capture_bs):
                self.graphs[bs], self.outputs[bs] = self._capture_one(bs, stream)
                if bs in self.cascade_bs:
                    graph, out = self._capture_one(bs, stream, cascade=True)
                    self.cascade_graphs[bs], self.cascade_outputs[bs] = graph, out
        finally:
            self.is_capturing = False
            pool.set_stream_overlap(False)
        torch.cuda.synchronize(self.device)

    def _capture_one(
        self, bs: int, stream: torch.cuda.Stream, cascade: bool = False
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        fb = self._forward_batch(bs, bs * self.seq_len_fill_value)
        backend = self.model_runner.attn_backend
        backend.init_forward_metadata_capture_cuda_graph(
            bs, bs, fb.req_pool_indices, fb.seq_lens, ForwardMode.DECODE
        )
        if cascade:
            backend.capture_cascade_cuda_graph(bs)
        # Warm up on the capture stream (lazy inits, Triton compiles) before capturing.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        greedy = self.model_runner.greedy
        with torch.cuda.stream(stream):
            for _ in range(2):
                out = self.model_runner.model_forward(fb)
                if greedy is not None:
                    greedy.launch(out)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_memory_pool, stream=stream):
            out = self.model_runner.model_forward(fb)  # [bs, V] logits
            if greedy is not None:  # the argmax too, into pinned host memory (greedy_ids)
                greedy.launch(out)
        if self.graph_memory_pool is None:
            self.graph_memory_pool = graph.pool()
        return graph, out

    # ---- replay ----
    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """Whether a captured graph can run this batch (decode, fits a bucket, same fusion)."""
        return (
            not self.is_capturing
            and bool(self.graphs)
            and forward_batch.forward_mode.is_cuda_graph()
            and forward_batch.batch_size <= self.max_bs
            and forward_batch.enable_fused_rope_kv == self.enable_fused_rope_kv
        )

    def static_inputs(self, bs: int, rows: int) -> torch.Tensor | None:
        """The static decode inputs' first bs columns (int64 [rows, bs], rows at the static
        block's stride) for a batch of bs requests to be written into directly: its replay then
        copies nothing. None when no graph can take bs requests or the row count differs."""
        block = self.decode_inputs
        if self.is_capturing or not self.graphs or not 1 <= bs <= self.max_bs:
            return None
        return block[:, :bs] if rows == block.shape[0] else None

    def bucket(self, raw_bs: int) -> int:
        """The captured batch size a batch of raw_bs replays."""
        return self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Run a decode batch through its graph.

        Returns
        -------
        float [B, V] logits: a view of the graph's static output, valid until the next replay.
        """
        raw_bs = forward_batch.batch_size
        bs = self.bucket(raw_bs)
        fill = self.seq_len_fill_value
        if bs != raw_bs:  # padding rows: harmless inputs, KV write to the padding slot 0
            self.decode_inputs[:, raw_bs:bs].copy_(self._padding[:, raw_bs:bs])
            self.seq_lens_cpu[raw_bs:bs].fill_(fill)
            if kv_write_checks_enabled():  # never a slot a request or the prefix cache holds
                check_padding_writes(self.decode_inputs[3, raw_bs:bs], self.model_runner.page_size)
        rows = self.decode_inputs.shape[0]
        block = _decode_block(forward_batch, raw_bs, rows)
        static = self.decode_inputs
        if block is not None and block.data_ptr() == static.data_ptr():
            assert block.stride() == static.stride()  # written there by the batch (no copy)
        elif block is not None:  # one copy: the host's work before the launch
            static[:, :raw_bs].copy_(block)
        else:
            fb = forward_batch
            assert fb.positions is not None  # decode batches carry their positions
            if self.hybrid and fb.out_cache_loc_swa is None:  # gathered here, outside the graph
                fb.out_cache_loc_swa = fb.token_to_kv_pool.translate_loc_from_full_to_swa(
                    fb.out_cache_loc
                )
            for dst, src in zip(self.decode_inputs, _decode_fields(fb, rows), strict=True):
                dst[:raw_bs].copy_(src)
        req_pool_indices, seq_lens, cpu_view = self._views[bs]
        seq_lens_cpu = forward_batch.seq_lens_cpu  # the batch's own when nothing is padded
        if seq_lens_cpu is not None and bs != raw_bs:
            self.seq_lens_cpu[:raw_bs].copy_(seq_lens_cpu)
            seq_lens_cpu = cpu_view
        seq_lens_sum = forward_batch.seq_lens_sum + (bs - raw_bs) * fill
        backend = self.model_runner.attn_backend
        backend.init_forward_metadata_replay_cuda_graph(
            bs, req_pool_indices, seq_lens, seq_lens_sum, ForwardMode.DECODE, seq_lens_cpu
        )
        shared = forward_batch.shared_prefixes
        cascade = shared is not None and bs in self.cascade_graphs
        if cascade and backend.replay_cascade_cuda_graph(bs, shared):
            self.cascade_graphs[bs].replay()
            out = self.cascade_outputs[bs]
        else:
            self.graphs[bs].replay()
            out = self.outputs[bs]
        out = out if raw_bs == bs else out[:raw_bs]
        greedy = self.model_runner.greedy
        if greedy is not None:  # the replay computes out's argmax (ModelRunner.greedy_ids)
            greedy.pending = out
        return out


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream graphs are captured on, one per device for the process: torch keeps a
    cuBLAS workspace (32 MiB on Hopper) per stream that ran a GEMM until the process ends, so a
    new stream per engine grew every later engine's footprint by one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream
