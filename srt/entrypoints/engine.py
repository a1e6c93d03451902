"""Engine: the offline entry point, `srt.Engine(...).generate(...)` as in SGLang.

No server: the engine owns a ModelRunner and a Scheduler (continuous batching with admission
control) and runs submitted requests to completion.

Tensor parallelism (tp_size > 1), two ways:
- launched by torchrun (or inside an initialised TP group): this process is one rank; every rank
  constructs the Engine and calls `generate` with the same inputs, and gets the same outputs;
- otherwise: the engine starts one worker process per rank (srt/entrypoints/tp_workers.py) and
  forwards each call to all of them, returning rank 0's outputs.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import os
import sys
from typing import Any

import torch

from srt.assets import TINY_TOKENIZER_DIR
from srt.distributed import (
    destroy_distributed_environment,
    init_distributed_environment,
    launched_by_torchrun,
    model_parallel_is_initialized,
)
from srt.managers.schedule_batch import Req
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

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
        self._tp_workers = None
        self._owns_tp_group = False
        self._closed = False
        if args.tp_size > 1 and not model_parallel_is_initialized():
            if launched_by_torchrun():
                if int(os.environ["WORLD_SIZE"]) != args.tp_size:
                    raise ValueError(
                        f"tp_size={args.tp_size} but torchrun started "
                        f"{os.environ['WORLD_SIZE']} processes (WORLD_SIZE); they must match"
                    )
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
            tok_path = args.tokenizer_path or args.model_path or TINY_TOKENIZER_DIR
            self.tokenizer = _load_tokenizer(tok_path)
        self.eos_token_ids = self._eos_token_ids()
        self._rid = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(args.random_seed)

    def _start_tp_workers(self) -> None:
        """Spawn one process per TP rank; this process only forwards calls (and tokenizes)."""
        from srt.entrypoints.tp_workers import TpWorkerGroup

        args = self.server_args
        self.model_runner = None  # type: ignore[assignment] - the ranks own the model
        self.scheduler = None  # type: ignore[assignment]
        self._tp_workers = TpWorkerGroup(
            args.tp_size, dataclasses.asdict(args), args.dist_init_addr, args.dist_timeout
        )
        tok_path = args.tokenizer_path or args.model_path or TINY_TOKENIZER_DIR
        self.tokenizer = None if args.skip_tokenizer_init else _load_tokenizer(tok_path)
        self.eos_token_ids = self._tp_workers.info["eos_token_ids"]

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        mc = self.model_runner.model_config
        eos = getattr(getattr(mc, "hf_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(mc, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    # ---- requests ----
    def _make_req(self, input_ids: list[int], params: SamplingParams, return_logprob: bool) -> Req:
        vocab = int(self.model_runner.model_config.vocab_size)
        if not input_ids:
            raise ValueError("a request needs at least one input token")
        bad = [t for t in input_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids {bad[:5]} outside the vocabulary [0, {vocab})")
        ctx = self.model_runner.context_len
        if len(input_ids) >= ctx:
            raise ValueError(f"prompt of {len(input_ids)} tokens >= context length {ctx}")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        generator = None
        if not params.is_greedy:
            generator = torch.Generator(device=self.model_runner.device).manual_seed(seed)
        return Req(
            rid=next(self._rid),
            origin_input_ids=list(input_ids),
            sampling_params=params,
            return_logprob=return_logprob,
            generator=generator,
            eos_token_ids=self.eos_token_ids,
            max_total_len=ctx,
        )

    def _tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass input_ids instead of prompt")
        return list(self.tokenizer.encode(prompt))

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        progress_bar: bool | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one request or a batch.

        Parameters
        ----------
        prompt : a string or a list of strings (needs a tokenizer).
        sampling_params : a dict (for all requests) or one dict per request; keys of
            SamplingParams: max_new_tokens, temperature (0 = greedy), top_k, top_p, min_p,
            stop_token_ids, ignore_eos, seed.
        input_ids : token ids instead of prompt: a list of ints or a list of lists.
        return_logprob : also return each output token's log-probability.
        progress_bar : show a tqdm bar (default: for 32 or more requests).

        Returns
        -------
        A dict for a single request, a list of dicts for a batch, each with `output_ids`,
        `text` (with a tokenizer), `output_token_logprobs` (on request) and `meta_info`
        (prompt_tokens, completion_tokens, finish_reason).
        """
        if self._closed:
            raise RuntimeError("generate() after shutdown()")
        if self._tp_workers is not None:
            return self._tp_workers.call(
                "generate",
                prompt=prompt,
                sampling_params=sampling_params,
                input_ids=input_ids,
                return_logprob=return_logprob,
                progress_bar=progress_bar,
            )
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise TypeError("prompt must be a string or a list of strings")
            token_lists = [self._tokenize(p) for p in prompts]
        else:
            single = len(input_ids) > 0 and isinstance(input_ids[0], int)
            token_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
        n = len(token_lists)
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(f"{len(sampling_params)} sampling_params for {n} requests")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * n
        logprob_flags = return_logprob if isinstance(return_logprob, list) else [return_logprob] * n
        reqs = [
            self._make_req(t, p, bool(lp))
            for t, p, lp in zip(token_lists, params, logprob_flags, strict=True)
        ]
        for r in reqs:
            self.scheduler.check_fits(r)
        for r in reqs:
            self.scheduler.add_request(r)
        show = progress_bar if progress_bar is not None else n >= PROGRESS_MIN_REQUESTS
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=n, desc="generate", file=sys.stderr)
        try:
            self.scheduler.run_until_idle(bar)
        except BaseException:
            self.scheduler.abort_all()  # leave no request holding KV memory
            raise
        finally:
            if bar is not None:
                bar.close()
        outs = [self._output(r) for r in reqs]
        return outs[0] if single else outs

    def _output(self, req: Req) -> dict[str, Any]:
        out: dict[str, Any] = {"output_ids": list(req.output_ids)}
        if self.tokenizer is not None:
            out["text"] = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "finish_reason": req.finished_reason,
        }
        if req.return_logprob:
            out["output_token_logprobs"] = list(req.output_token_logprobs)
            pairs = zip(req.output_token_logprobs, req.output_ids, strict=True)
            meta["output_token_logprobs"] = [(lp, tok, None) for lp, tok in pairs]
        out["meta_info"] = meta
        return out

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
