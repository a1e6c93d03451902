"""Engine: the offline entry point, `srt.Engine(...).generate(...)` as in SGLang.

The engine owns a ModelRunner and a Scheduler (continuous batching with admission control). One
EngineLoop thread runs the scheduler (engine_loop.py); `generate` from any thread,
`async_generate` coroutines and the HTTP server (http_server.py) all submit to it, so their
requests share one continuous batch (engine_client.py is the callers' side). Requests are
checked when they are built (request_builder.py); one that still fails inside a step fails
alone (the scheduler retries the step without it).

Tensor parallelism (tp_size > 1), two ways:
- launched by torchrun (or inside an initialised TP group): this process is one rank; every rank
  constructs the Engine and calls `generate` with the same inputs, and gets the same outputs;
- otherwise: the engine starts one worker process per rank (srt/entrypoints/tp_workers.py) and
  forwards each call to all of them, returning rank 0's outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from srt.assets import TINY_TOKENIZER_DIR
from srt.distributed import (
    destroy_distributed_environment,
    init_distributed_environment,
    launched_by_torchrun,
    model_parallel_is_initialized,
    torchrun_world_size,
)
from srt.entrypoints import engine_client
from srt.entrypoints.engine_loop import EngineLoop
from srt.entrypoints.outputs import RequestError, error_output, final_output
from srt.entrypoints.request_builder import ModelLimits, PreparedBatch, RequestBuilder
from srt.entrypoints.server_info import server_info
from srt.managers.schedule_batch import Req
from srt.managers.scheduler import Scheduler
from srt.server_args import ServerArgs

if TYPE_CHECKING:
    from srt.entrypoints.tp_workers import TpWorkerGroup

logger = logging.getLogger(__name__)

PROGRESS_MIN_REQUESTS = 32


def _load_tokenizer(path: str | None) -> Any:
    """The tokenizer in `path` (a local directory), or None if it has none or it is unusable."""
    from srt.model_loader.loader import load_tokenizer

    try:
        return load_tokenizer(path)
    except (ValueError, ImportError) as e:  # a model without a usable tokenizer still runs
        logger.warning("no tokenizer loaded from %s: %s", path, e)
        return None


async def _async_chunks(chunks: Iterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Each chunk of a streaming generate, the steps run in a worker thread."""
    done = object()
    try:
        while True:
            chunk = await asyncio.to_thread(next, chunks, done)
            if chunk is done:
                return
            yield chunk  # type: ignore[misc]
    finally:
        chunks.close()  # type: ignore[attr-defined]


def _shut_down(req: object) -> None:
    raise RuntimeError("the engine is shut down")


class Engine:
    """Offline inference engine.

    Parameters
    ----------
    model_path : HF checkpoint directory; None builds the embedded tiny Llama (random weights,
        seeded by random_seed) and uses the tiny tokenizer at srt/assets/tiny_tokenizer/ if
        present.
    load_format : "auto" or "dummy" (random weights).
    device : "cuda" or "cpu" (default: cuda if available).
    dtype, kv_cache_dtype, page_size, enable_fused_rope_kv : see ServerArgs.
    cuda_graph : capture decode CUDA graphs (GPU only).
    tp_size : tensor-parallel ranks (see the module docstring).
    **kwargs : any other ServerArgs field (max_total_tokens, max_running_requests, ...).
    """

    def __init__(
        self,
        model_path: str | None = None,
        load_format: str = "auto",
        device: str | None = None,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        page_size: int = 1,
        enable_fused_rope_kv: bool = True,
        cuda_graph: bool = True,
        tp_size: int = 1,
        **kwargs: Any,
    ) -> None:
        fields = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"Engine got unknown arguments {unknown}")
        if "disable_cuda_graph" in kwargs:
            cuda_graph = cuda_graph and not kwargs.pop("disable_cuda_graph")
        self.server_args = ServerArgs(
            model_path=model_path,
            load_format=load_format,
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            page_size=page_size,
            enable_fused_rope_kv=enable_fused_rope_kv,
            disable_cuda_graph=not cuda_graph,
            tp_size=tp_size,
            **kwargs,
        ).resolved()
        args = self.server_args
        if args.log_level is not None:
            logging.getLogger("srt").setLevel(args.log_level.upper())
        self._tp_workers: TpWorkerGroup | None = None
        self._owns_tp_group = False
        self._closed = False
        self._loop: EngineLoop | None = None
        self._loop_lock = threading.Lock()
        self._call_lock = threading.Lock()  # TP: one call at a time (see _serial)
        if args.tp_size > 1 and not model_parallel_is_initialized():
            if launched_by_torchrun():
                world = torchrun_world_size()
                if world != args.tp_size:
                    raise ValueError(
                        f"tp_size={args.tp_size} but torchrun started {world} processes "
                        "(WORLD_SIZE); they must match"
                    )
                assert args.device is not None  # resolved() fills it
                backend = "nccl" if args.device.startswith("cuda") else "gloo"
                init_distributed_environment(
                    args.tp_size, backend=backend, timeout_s=args.dist_timeout
                )
                self._owns_tp_group = True
            else:
                self._start_tp_workers()
                return
        from srt.model_executor.model_runner import ModelRunner

        self.model_runner = ModelRunner(self.server_args)
        self.scheduler = Scheduler(self.model_runner)
        if args.skip_tokenizer_init:
            self.tokenizer = None
        else:
            tok_path = str(args.tokenizer_path or args.model_path or TINY_TOKENIZER_DIR)
            self.tokenizer = _load_tokenizer(tok_path)
        self.eos_token_ids = self._eos_token_ids()
        runner = self.model_runner
        limits = ModelLimits(
            vocab_size=int(runner.model_config.vocab_size),
            context_len=runner.context_len,
            allow_auto_truncate=args.allow_auto_truncate,
            device=runner.device,
            check_fits=self.scheduler.check_fits,
        )
        self._builder = RequestBuilder(self.tokenizer, self.eos_token_ids, limits, args.random_seed)

    def _start_tp_workers(self) -> None:
        """Spawn one process per TP rank; this process only forwards calls (and tokenizes)."""
        from srt.entrypoints.tp_workers import TpWorkerGroup

        args = self.server_args
        self.model_runner = None  # type: ignore[assignment]  # the ranks own the model
        self.scheduler = None  # type: ignore[assignment]
        self._tp_workers = TpWorkerGroup(
            args.tp_size, Engine, dataclasses.asdict(args), args.dist_init_addr, args.dist_timeout
        )
        tok_path = str(args.tokenizer_path or args.model_path or TINY_TOKENIZER_DIR)
        self.tokenizer = None if args.skip_tokenizer_init else _load_tokenizer(tok_path)
        self.eos_token_ids = self._tp_workers.info["eos_token_ids"]

    def _eos_token_ids(self) -> frozenset[int]:
        # ModelConfig.eos_token_id is the HF config's eos_token_id as a tuple (hf_config is a
        # read-only mapping, not an object with attributes).
        eos = self.model_runner.model_config.eos_token_id
        ids = {int(eos)} if isinstance(eos, int) else {int(e) for e in eos or ()}
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    # ---- requests ----
    def make_requests(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        extra_key: str | list[str] | None = None,
    ) -> PreparedBatch:
        """Check and build the requests of one `generate` call without running them
        (`RequestBuilder.make`: a bad request becomes a RequestError in its place)."""
        return self._builder.make(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            extra_key=extra_key,
        )

    def output(self, item: Req | RequestError) -> dict[str, Any]:
        """The result dict of a finished request or of a rejected one."""
        if isinstance(item, RequestError):
            return error_output(item, with_text=self.tokenizer is not None)
        return final_output(item, self.tokenizer)

    def engine_loop(self) -> EngineLoop:
        """The thread that runs this engine's scheduler for every caller (started on first use,
        and again after it was closed). The HTTP server submits to it too."""
        with self._loop_lock:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            if self._loop is None or not self._loop.alive:
                self._loop = EngineLoop(self)
            return self._loop

    def _prepare(
        self, prompt: Any, sampling_params: Any, input_ids: Any, lp: Any, lp_args: dict[str, Any]
    ) -> PreparedBatch:
        """The call's checked requests; a bad one refuses the whole call, naming its index
        (lp_args: make_requests' logprob_start_len, top_logprobs_num, return_text_in_logprobs,
        extra_key)."""
        if self._closed:
            raise RuntimeError("generate() after shutdown()")
        batch = self.make_requests(prompt, sampling_params, input_ids, lp, **lp_args)
        batch.raise_first_error()
        return batch

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        progress_bar: bool | None = None,
        stream: bool = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        extra_key: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one request or a batch. Safe to call from several threads at once.

        Parameters
        ----------
        prompt : a string or a list of strings (needs a tokenizer).
        sampling_params : a dict (for all requests) or one dict per request, with SGLang's
            keys (see SamplingParams): max_new_tokens, min_new_tokens, temperature (0 =
            greedy), top_k, top_p, min_p, frequency/presence/repetition_penalty, stop,
            stop_token_ids, ignore_eos, skip_special_tokens, no_stop_trim, n, sampling_seed
            (alias seed).
        input_ids : token ids instead of prompt: a list of ints or a list of lists.
        return_logprob : also return log-probabilities, SGLang's meta_info fields
            (srt/entrypoints/logprob_io.py); those of the distribution a token is drawn from.
        progress_bar : show a tqdm bar (default: for 32 or more requests; not when streaming).
        stream : return an iterator of chunks instead (see below).
        logprob_start_len, top_logprobs_num, return_text_in_logprobs : SGLang's, see
            logprob_io.py (like return_logprob, one value or a list with one per prompt).
        extra_key : SGLang's: a string, or one per prompt; requests with different keys never
            share a cached prefix (a tenant or cache salt).

        Returns
        -------
        A dict for a single request (one prompt, n = 1), else a list of dicts (prompt-major,
        the n outputs of a prompt next to each other), each with `output_ids`, `text` (with a
        tokenizer), `output_token_logprobs` (on request) and `meta_info` (id, finish_reason,
        prompt_tokens, completion_tokens, cached_tokens, e2e_latency, truncation if cut).

        Every request is checked before any is scheduled: a bad one (empty prompt, ids outside
        the vocabulary, a sampling value out of range or beyond float32, a wrong `stop` type, a
        seed out of range, n > 128, too long for the context) raises its ValueError / TypeError
        for the whole call, naming it ("request 2: temperature must be ...") in a list call.
        A request that still fails inside a forward or sampling step fails alone (the step is
        retried without it; the others' tokens are unchanged): a single request raises that
        error, in a list its entry has `error` (the message), the tokens it had and
        finish_reason {"type": "abort", "message": ..., "status_code": 500}.

        Calls from any thread (and `async_generate` coroutines) join one continuous batch run
        by the engine's loop thread (`engine_loop`); each call waits for its own outputs.

        With stream=True: an iterator of chunks, each with `output_ids`, `text` and
        `meta_info` so far (finish_reason set in its last chunk) and, for a batch, `index` (its
        position in the list above). Cumulative, as SGLang's: every chunk has the whole output
        so far; with server arg `incremental_streaming_output=True` only what is new since
        the request's previous chunk. Closing the iterator early aborts the requests still
        running and frees their memory.
        """
        if self._closed:
            raise RuntimeError("generate() after shutdown()")
        lp_args: dict[str, Any] = dict(  # per-request arguments beside the sampling params
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            extra_key=extra_key,
        )
        if self._tp_workers is not None:
            if stream:
                raise ValueError("stream=True needs tp_size=1 or ranks launched by torchrun")
            with self._call_lock:  # the workers' pipes carry one call at a time
                return self._tp_workers.call(
                    "generate",
                    prompt=prompt,
                    sampling_params=sampling_params,
                    input_ids=input_ids,
                    return_logprob=return_logprob,
                    progress_bar=progress_bar,
                    **lp_args,
                )
        batch = self._prepare(prompt, sampling_params, input_ids, return_logprob, lp_args)
        if stream:
            return self._stream(batch)
        n = len(batch.items)
        show = progress_bar if progress_bar is not None else n >= PROGRESS_MIN_REQUESTS
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=n, desc="generate", file=sys.stderr)
        try:
            with self._serial():
                outs = engine_client.run(self.engine_loop(), batch, bar)
        finally:
            if bar is not None:
                bar.close()
        return outs[0] if batch.single else outs

    def _serial(self) -> AbstractContextManager[Any]:
        """TP ranks in this process (torchrun) run one call at a time, so that every rank
        schedules the same batches; a single rank batches every caller together."""
        return self._call_lock if self.server_args.tp_size > 1 else contextlib.nullcontext()

    def _stream(self, batch: PreparedBatch) -> Iterator[dict[str, Any]]:
        with self._serial():
            yield from engine_client.stream(self.engine_loop(), batch)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        stream: bool = False,
        **logprob_args: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """`generate` for asyncio code; concurrent calls (asyncio.gather) join one batch.

        logprob_args: generate's logprob_start_len, top_logprobs_num, return_text_in_logprobs,
        extra_key.
        Returns what `generate` returns; with stream=True an async iterator of the same
        chunks (`async for chunk in await engine.async_generate(..., stream=True)`).
        """
        if self._tp_workers is not None or self.server_args.tp_size > 1:
            # one call at a time: the blocking call runs in a worker thread
            args = (prompt, sampling_params, input_ids, return_logprob)
            if not stream:
                out = await asyncio.to_thread(self.generate, *args, False, **logprob_args)
                assert not isinstance(out, Iterator)  # stream=False
                return out
            chunks = self.generate(*args, stream=True, **logprob_args)
            return _async_chunks(chunks)  # type: ignore[arg-type]
        batch = self._prepare(prompt, sampling_params, input_ids, return_logprob, logprob_args)
        if stream:
            return engine_client.async_stream(self.engine_loop(), batch)
        outs = await engine_client.async_run(self.engine_loop(), batch)
        return outs[0] if batch.single else outs

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's `get_server_info`: the resolved ServerArgs, the KV pool's size, request
        limits, the model's config basics, the scheduler's state and the version
        (srt/entrypoints/server_info.py). Safe from any thread."""
        return server_info(self)

    def flush_cache(self) -> bool:
        """SGLang's flush_cache: drop the prefix cache. Only while no request waits or runs;
        returns whether it was flushed. Safe from any thread (it runs between two steps)."""
        if self._tp_workers is not None:  # every rank flushes: their trees stay in lockstep
            with self._call_lock:
                return bool(self._tp_workers.call("flush_cache"))
        assert self.scheduler is not None
        loop = self._loop
        if loop is not None and loop.alive:
            return bool(loop.call(self.scheduler.flush_cache))
        return self.scheduler.flush_cache()

    def get_kv_memory_report(self) -> Any:
        """The KV pools' `KVMemoryReport` (bytes per token of full and window layers, tokens
        that fit; `.describe()` words it), or None when the ranks run in worker processes."""
        runner = getattr(self, "model_runner", None)
        return None if runner is None else runner.kv_memory_report

    def shutdown(self) -> None:
        """Release the model, the KV cache and the CUDA graphs."""
        if self._closed:
            return
        with self._loop_lock:
            self._closed = True
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()
        if self._tp_workers is not None:
            self._tp_workers.close()
            return
        runner = self.model_runner
        runner.cuda_graph_runner = None
        # The request builder's pool check is the scheduler's bound method: drop it, or the
        # builder keeps the scheduler, the runner, the KV pool and the graphs alive.
        limits = dataclasses.replace(self._builder.limits, check_fits=_shut_down)
        self._builder.limits = limits
        self.scheduler = None  # type: ignore[assignment]
        self.model_runner = None  # type: ignore[assignment]
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self._owns_tp_group:
            destroy_distributed_environment()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
