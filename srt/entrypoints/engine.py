"""Engine: the offline entry point, `srt.Engine(...).generate(...)` as in SGLang.

The engine owns a ModelRunner and a Scheduler (continuous batching with admission control) and
runs submitted requests to completion; `generate(..., stream=True)` yields increments and
`async_generate` serves asyncio code. The HTTP server (http_server.py) drives the same engine
from one EngineLoop thread.

Tensor parallelism (tp_size > 1), two ways:
- launched by torchrun (or inside an initialised TP group): this process is one rank; every rank
  constructs the Engine and calls `generate` with the same inputs, and gets the same outputs;
- otherwise: the engine starts one worker process per rank (srt/entrypoints/tp_workers.py) and
  forwards each call to all of them, returning rank 0's outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from srt.assets import TINY_TOKENIZER_DIR
from srt.distributed import (
    destroy_distributed_environment,
    init_distributed_environment,
    launched_by_torchrun,
    model_parallel_is_initialized,
)
from srt.entrypoints.outputs import RequestError, StreamState, error_output, final_output
from srt.entrypoints.request_checks import check_input_ids, fit_context
from srt.managers.schedule_batch import Req
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
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


@dataclass(frozen=True)
class PreparedBatch:
    """The checked requests of one `generate` call.

    Attributes
    ----------
    single : the call named one request (one prompt, n = 1): return a dict, not a list.
    items : one Req or RequestError per output, prompt-major (n per prompt).
    """

    single: bool
    items: tuple[Req | RequestError, ...]


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
        if args.tp_size > 1 and not model_parallel_is_initialized():
            if launched_by_torchrun():
                if int(os.environ["WORLD_SIZE"]) != args.tp_size:
                    raise ValueError(
                        f"tp_size={args.tp_size} but torchrun started "
                        f"{os.environ['WORLD_SIZE']} processes (WORLD_SIZE); they must match"
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
        self._seed_rng = torch.Generator().manual_seed(args.random_seed)

    def _start_tp_workers(self) -> None:
        """Spawn one process per TP rank; this process only forwards calls (and tokenizes)."""
        from srt.entrypoints.tp_workers import TpWorkerGroup

        args = self.server_args
        self.model_runner = None  # type: ignore[assignment]  # the ranks own the model
        self.scheduler = None  # type: ignore[assignment]
        self._tp_workers = TpWorkerGroup(
            args.tp_size, dataclasses.asdict(args), args.dist_init_addr, args.dist_timeout
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
    def _new_reqs(
        self, raw: Any, sampling_params: Any, return_logprob: bool
    ) -> list[Req | RequestError]:
        """The `n` requests of one prompt (str) or token list, or their errors."""
        now = time.perf_counter()
        rids = [uuid.uuid4().hex]
        try:
            params = SamplingParams.from_dict(sampling_params)
            rids += [uuid.uuid4().hex for _ in range(params.n - 1)]
            if isinstance(raw, str):
                ids = self._tokenize(raw)
            else:
                ids = check_input_ids(raw, int(self.model_runner.model_config.vocab_size))
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer: use stop_token_ids")
            ids, params, meta = fit_context(
                ids, params, self.model_runner.context_len, self.server_args.allow_auto_truncate
            )
            reqs: list[Req | RequestError] = []
            for j, rid in enumerate(rids):
                seed = params.sampling_seed
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
                else:
                    seed += j
                generator = None
                if not params.is_greedy:
                    device = self.model_runner.device
                    generator = torch.Generator(device=device).manual_seed(seed)
                req = Req(
                    rid=rid,
                    origin_input_ids=list(ids),
                    sampling_params=params,
                    return_logprob=bool(return_logprob),
                    generator=generator,
                    eos_token_ids=self.eos_token_ids,
                    max_total_len=self.model_runner.context_len,
                    decode=self._decode_for_stop if params.stop else None,
                    created_time=now,
                    meta=dict(meta),
                )
                self.scheduler.check_fits(req)
                reqs.append(req)
            return reqs
        except (ValueError, TypeError) as e:
            return [RequestError(rid, e) for rid in rids]

    def _decode_for_stop(self, ids: list[int]) -> str:
        tokenizer = self.tokenizer
        assert tokenizer is not None  # _new_reqs refuses stop strings without a tokenizer
        return tokenizer.decode(ids, skip_special_tokens=True)

    def _tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass input_ids instead of prompt")
        return list(self.tokenizer.encode(prompt))

    def make_requests(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
    ) -> PreparedBatch:
        """Check and build the requests of one `generate` call without running them.

        A request with bad input or sampling parameters becomes a RequestError in its place
        (its `n` places); the call itself raises only for a malformed call (both or neither of
        prompt and input_ids, list lengths that do not match) and, for a single request, with
        that request's error.
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        raws: list[Any]  # prompts (str) or token lists, one per request
        if prompt is not None:
            single = isinstance(prompt, str)
            raws = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in raws):
                raise TypeError("prompt must be a string or a list of strings")
        else:
            if isinstance(input_ids, torch.Tensor):
                input_ids = input_ids.tolist()
            if not isinstance(input_ids, (list, tuple)):
                raise TypeError(
                    f"input_ids must be a list of ints or of lists, got {type(input_ids).__name__}"
                )
            single = not input_ids or not isinstance(input_ids[0], (list, tuple, torch.Tensor))
            raws = [input_ids] if single else list(input_ids)
        n = len(raws)
        per_req: Sequence[dict[str, Any] | None]  # one per request
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(f"{len(sampling_params)} sampling_params for {n} requests")
            per_req = sampling_params
        else:
            per_req = [sampling_params] * n
        logprob_flags = return_logprob if isinstance(return_logprob, list) else [return_logprob] * n
        if len(logprob_flags) != n:
            raise ValueError(f"{len(logprob_flags)} return_logprob flags for {n} requests")
        items: list[Req | RequestError] = []
        for raw, sp, lp in zip(raws, per_req, logprob_flags, strict=True):
            items.extend(self._new_reqs(raw, sp, lp))
        if single and isinstance(items[0], RequestError):  # (n > 1: the same error n times)
            raise items[0].error
        return PreparedBatch(single=single and len(items) == 1, items=tuple(items))

    def output(self, item: Req | RequestError) -> dict[str, Any]:
        """The result dict of a finished request or of a rejected one."""
        if isinstance(item, RequestError):
            return error_output(item, with_text=self.tokenizer is not None)
        return final_output(item, self.tokenizer)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        progress_bar: bool | None = None,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one request or a batch.

        Parameters
        ----------
        prompt : a string or a list of strings (needs a tokenizer).
        sampling_params : a dict (for all requests) or one dict per request, with SGLang's
            keys (see SamplingParams): max_new_tokens, min_new_tokens, temperature (0 =
            greedy), top_k, top_p, min_p, frequency/presence/repetition_penalty, stop,
            stop_token_ids, ignore_eos, skip_special_tokens, no_stop_trim, n, sampling_seed
            (alias seed).
        input_ids : token ids instead of prompt: a list of ints or a list of lists.
        return_logprob : also return each output token's log-probability.
        progress_bar : show a tqdm bar (default: for 32 or more requests; not when streaming).
        stream : return an iterator of incremental dicts instead (see below).

        Returns
        -------
        A dict for a single request (one prompt, n = 1), else a list of dicts (prompt-major,
        the n outputs of a prompt next to each other), each with `output_ids`, `text` (with a
        tokenizer), `output_token_logprobs` (on request) and `meta_info` (id, finish_reason,
        prompt_tokens, completion_tokens, cached_tokens, e2e_latency, truncation if cut).
        In a batch, a request with bad input or parameters does not run: its entry has
        `error` (the message), no tokens and finish_reason {"type": "abort", ...}; the others
        run. A single bad request raises its ValueError / TypeError.

        With stream=True: an iterator of chunks, each with the new `output_ids` and `text`
        since the previous chunk of that request, `meta_info` so far (finish_reason set in its
        last chunk) and, for a batch, `index` (its position in the list above). Closing the
        iterator early aborts the requests still running and frees their memory.
        """
        if self._closed:
            raise RuntimeError("generate() after shutdown()")
        if self._tp_workers is not None:
            if stream:
                raise ValueError("stream=True needs tp_size=1 or ranks launched by torchrun")
            return self._tp_workers.call(
                "generate",
                prompt=prompt,
                sampling_params=sampling_params,
                input_ids=input_ids,
                return_logprob=return_logprob,
                progress_bar=progress_bar,
            )
        batch = self.make_requests(prompt, sampling_params, input_ids, return_logprob)
        if stream:
            return self._stream(batch)
        reqs = [r for r in batch.items if isinstance(r, Req)]
        for r in reqs:
            self.scheduler.add_request(r)
        show = progress_bar if progress_bar is not None else len(reqs) >= PROGRESS_MIN_REQUESTS
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(reqs), desc="generate", file=sys.stderr)
        try:
            self.scheduler.run_until_idle(bar)
        except BaseException:
            self.scheduler.abort_all()  # leave no request holding KV memory
            raise
        finally:
            if bar is not None:
                bar.close()
        first = batch.items[0] if batch.items else None
        if batch.single and isinstance(first, Req) and first.error is not None:
            raise first.error  # failed inside a step (in a list: that entry's `error`)
        outs = [self.output(x) for x in batch.items]
        return outs[0] if batch.single else outs

    def _stream(self, batch: PreparedBatch) -> Iterator[dict[str, Any]]:
        """The chunks of `generate(..., stream=True)`."""
        states: dict[int, StreamState] = {}
        pending: list[tuple[int, dict[str, Any]]] = []
        for i, item in enumerate(batch.items):
            if isinstance(item, RequestError):
                pending.append((i, self.output(item)))
            else:
                self.scheduler.add_request(item)
                states[i] = StreamState(item, self.tokenizer)
        try:
            while True:
                for i, chunk in pending:
                    if not batch.single:
                        chunk["index"] = i
                    yield chunk
                if not self.scheduler.has_work():
                    return
                self.scheduler.step()
                pending = []
                for i, st in states.items():
                    update = st.next_chunk()
                    if update is not None:
                        pending.append((i, update))
        except BaseException:
            self.scheduler.abort_all()  # an error, or the consumer closed the iterator
            raise

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """`generate` for asyncio code: the forward passes run in a worker thread.

        Returns what `generate` returns; with stream=True an async iterator of the same
        chunks (`async for chunk in await engine.async_generate(..., stream=True)`).
        The engine runs one call at a time: do not overlap calls on one engine.
        """
        if not stream:
            out = await asyncio.to_thread(
                self.generate, prompt, sampling_params, input_ids, return_logprob, False
            )
            assert not isinstance(out, Iterator)  # stream=False
            return out
        chunks = self.generate(prompt, sampling_params, input_ids, return_logprob, stream=True)
        return _async_chunks(chunks)  # type: ignore[arg-type]

    def get_kv_memory_report(self) -> Any:
        """The KV pools' `KVMemoryReport` (bytes per token of full and window layers, tokens
        that fit; `.describe()` words it), or None when the ranks run in worker processes."""
        runner = getattr(self, "model_runner", None)
        return None if runner is None else runner.kv_memory_report

    def shutdown(self) -> None:
        """Release the model, the KV cache and the CUDA graphs."""
        if self._closed:
            return
        self._closed = True
        if self._tp_workers is not None:
            self._tp_workers.close()
            return
        runner = self.model_runner
        runner.cuda_graph_runner = None
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
