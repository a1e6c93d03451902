"""RequestBuilder: checks and builds the requests of one `generate` call (any caller's thread).

Every value of a request is checked here, before anything is scheduled: the prompt (a string
that encodes to no token is refused, as `input_ids: []` is), the token ids, the sampling
parameters (`SamplingParams`: float32 range, stop, seed, n, logit_bias; its token ids against
the vocabulary), the logprob arguments (`logprob_io.logprob_req_fields`: top_logprobs_num,
logprob_start_len within the prompt), the context length and whether the KV pool could ever
hold the request. A request that would fail a forward step for this reason
never reaches one.

Per request, an error becomes a `RequestError` in the request's place (`make`): the HTTP loop
answers it as that request's entry. The Engine's own calls (`generate`, `async_generate`,
streams) refuse the whole call instead, before any request is scheduled, with the first bad
request's error naming its index (`PreparedBatch.raise_first_error`), as SGLang does, and as
`srt/eval/engine_io.py` expects (it retries a refused batch one prompt at a time).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from srt.entrypoints.logprob_io import logprob_req_fields, per_request_logprob_args
from srt.entrypoints.outputs import RequestError
from srt.entrypoints.request_checks import check_input_ids, fit_context
from srt.managers.schedule_batch import Req
from srt.sampling.logit_bias import check_logit_bias_vocab
from srt.sampling.sampling_params import SamplingParams


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

    @property
    def reqs(self) -> list[Req]:
        return [r for r in self.items if isinstance(r, Req)]

    def raise_first_error(self) -> None:
        """Raise the first rejected request's error, naming its index ("request 2: ...");
        ValueError, or TypeError for a value of the wrong type."""
        bad = next((x for x in self.items if isinstance(x, RequestError)), None)
        if bad is None:
            return
        if self.single:
            raise bad.error
        cls = TypeError if isinstance(bad.error, TypeError) else ValueError
        raise cls(f"request {bad.index}: {bad.error}") from bad.error


@dataclass(frozen=True)
class ModelLimits:
    """What the model and its KV pool allow a request (for RequestBuilder)."""

    vocab_size: int
    context_len: int
    allow_auto_truncate: bool
    device: torch.device
    check_fits: Callable[[Req], None]  # raises ValueError if the KV pool could never hold it


class RequestBuilder:
    """Builds checked requests; safe to call from several threads at once.

    Parameters
    ----------
    tokenizer : HF tokenizer, or None (then only input_ids are accepted).
    eos_token_ids : the model's EOS ids (stop unless ignore_eos).
    limits : the model's ModelLimits.
    random_seed : seeds the draw of a seed for sampled requests that bring none.
    """

    def __init__(
        self, tokenizer: Any, eos_token_ids: frozenset[int], limits: ModelLimits, random_seed: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.limits = limits
        self._seed_rng = torch.Generator().manual_seed(random_seed)
        self._seed_lock = threading.Lock()  # the seed generator is shared by every caller

    def _draw_seed(self) -> int:
        with self._seed_lock:
            return int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))

    def _tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass input_ids instead of prompt")
        ids = list(self.tokenizer.encode(prompt))
        if not ids:
            raise ValueError(f"prompt {prompt!r} is empty: it encodes to no tokens")
        return ids

    def decode_for_stop(self, ids: list[int]) -> str:
        tokenizer = self.tokenizer
        assert tokenizer is not None  # requests refuse stop strings without a tokenizer
        return tokenizer.decode(ids, skip_special_tokens=True)

    def _new_reqs(
        self,
        raw: Any,
        sampling_params: Any,
        logprob_args: dict[str, Any],
        index: int,
        extra_key: str | None = None,
    ) -> list[Req | RequestError]:
        """The `n` requests of one prompt (str) or token list, or their errors (logprob_args:
        this prompt's, see srt/entrypoints/logprob_io.py; extra_key: its prefix-cache key)."""
        now = time.perf_counter()
        rids = [uuid.uuid4().hex]
        lim = self.limits
        try:
            params = SamplingParams.from_dict(sampling_params)
            rids += [uuid.uuid4().hex for _ in range(params.n - 1)]
            if isinstance(raw, str):
                ids = self._tokenize(raw)
            else:
                ids = check_input_ids(raw, lim.vocab_size)
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer: use stop_token_ids")
            ids, params, meta = fit_context(ids, params, lim.context_len, lim.allow_auto_truncate)
            check_logit_bias_vocab(params.logit_bias, lim.vocab_size)
            logprob_fields = logprob_req_fields(logprob_args, len(ids))
            reqs: list[Req | RequestError] = []
            for j, rid in enumerate(rids):
                seed = params.sampling_seed
                seed = self._draw_seed() if seed is None else seed + j
                generator = None
                if not params.is_greedy:
                    generator = torch.Generator(device=lim.device).manual_seed(seed)
                req = Req(
                    rid=rid,
                    origin_input_ids=list(ids),
                    sampling_params=params,
                    **logprob_fields,
                    generator=generator,
                    eos_token_ids=self.eos_token_ids,
                    max_total_len=lim.context_len,
                    decode=self.decode_for_stop if params.stop else None,
                    created_time=now,
                    meta=dict(meta),
                    extra_key=extra_key,
                )
                lim.check_fits(req)
                reqs.append(req)
            return reqs
        except (ValueError, TypeError) as e:
            return [RequestError(rid, e, index) for rid in rids]

    def make(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool | list[bool] = False,
        extra_key: str | list[str] | None = None,
    ) -> PreparedBatch:
        """Check and build the requests of one `generate` call without running them.

        extra_key (SGLang's): one string, or one per prompt; requests with different keys never
        share a cached prefix (a tenant, a LoRA adapter, a cache salt).

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
            raws = [prompt] if single else list(prompt)  # type: ignore[arg-type]
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
        logprob_flags = per_request_logprob_args(
            n,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
        )
        keys = _per_request_keys(extra_key, n)
        items: list[Req | RequestError] = []
        for i, (raw, sp, lp) in enumerate(zip(raws, per_req, logprob_flags, strict=True)):
            items.extend(self._new_reqs(raw, sp, lp, i, keys[i]))
        if single and isinstance(items[0], RequestError):  # (n > 1: the same error n times)
            raise items[0].error
        return PreparedBatch(single=single and len(items) == 1, items=tuple(items))


def _per_request_keys(extra_key: Any, n: int) -> list[str | None]:
    """extra_key as one entry per request: None, a string for all, or a list of n strings."""
    keys = extra_key if isinstance(extra_key, (list, tuple)) else [extra_key] * n
    if len(keys) != n:
        raise ValueError(f"{len(keys)} extra_key values for {n} requests")
    for k in keys:
        if k is not None and not isinstance(k, str):
            raise TypeError(f"extra_key must be a string or a list of strings, got {k!r}")
    return list(keys)
