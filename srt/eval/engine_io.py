"""How evals talk to the offline Engine: build it, template and tokenize prompts, generate.

Kept apart from any one benchmark so that a new eval reuses it. Only the Engine's public
surface is used (``Engine(...)``, ``engine.tokenizer``, ``engine.generate``,
``engine.shutdown``), so tests can pass any object with that surface instead.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One prompt's outcome: its text, or the error that rejected it (then text is None), and
    its prompt's token counts where the engine reports them (cached: taken from the prefix
    cache; None: not reported)."""

    text: str | None
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


def _engine_class() -> type:
    from srt.entrypoints.engine import Engine  # imported late: evals sit on top of the stack

    return Engine


def make_engine(args: argparse.Namespace, fused: bool) -> Any:
    """An Engine for the eval's command line, with the fused RoPE+KV path on or off.

    ``random_seed=args.seed`` seeds the dummy (random) weights, so that the fused and the
    unfused engine hold the same model and their outputs can be compared token for token.
    """
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    impl: dict[str, Any] = {}
    if getattr(args, "model_impl", "srt") == "sglang":  # SGLang's own model file
        impl = {"model_impl": "sglang", "model_file": args.model_file}
    if getattr(args, "disable_radix_cache", False):
        impl["disable_radix_cache"] = True
    return _engine_class()(
        model_path=args.model_path,
        load_format=args.load_format,
        device=device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=args.page_size,
        enable_fused_rope_kv=fused,
        cuda_graph=device.startswith("cuda") and not args.disable_cuda_graph,
        random_seed=args.seed,
        **impl,
    )


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def prompt_token_ids(tokenizer: Any, text: str) -> tuple[str, list[int]]:
    """Wrap ``text`` as one user turn with the chat template (if any) and tokenize it.

    Returns
    -------
    (prompt, ids)
        The exact prompt string the model sees and its token ids. With a chat template the
        template supplies BOS etc., so no special tokens are added a second time; without one
        the tokenizer's own ``add_special_tokens`` behaviour applies.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return prompt, list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return text, list(tokenizer(text)["input_ids"])


def _error_of(out: dict[str, Any]) -> str:
    """An error entry's message: a rejected request's ValueError, or a request that failed
    alone inside a step (status 500, its message names the exception)."""
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    if (reason.get("status_code") or 400) >= 500:
        return f"failed inside the engine: {out['error']}"
    return f"ValueError: {out['error']}"


def _completions_of(engine: Any, outputs: Any, n: int) -> list[Completion]:
    """One Completion per output: its text, or, for a per-request error entry (a request the
    engine rejected, or one that failed alone inside a step while the others ran), that
    error: an error row, never a text to score."""
    if isinstance(outputs, dict):  # a single request may come back unwrapped
        outputs = [outputs]
    if len(outputs) != n:
        raise RuntimeError(f"engine returned {len(outputs)} outputs for {n}")
    done = []
    for out in outputs:
        if out.get("error") is not None:
            done.append(Completion(None, _error_of(out)))
            continue
        text = out.get("text")
        if text is None:
            text = engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
        meta = out.get("meta_info") or {}
        done.append(Completion(text, None, meta.get("prompt_tokens"), meta.get("cached_tokens")))
    return done


def context_length(engine: Any) -> int | None:
    """The longest prompt + output the engine serves, where it says (None for a stand-in)."""
    runner = getattr(engine, "model_runner", None)
    ctx = getattr(runner, "context_len", None)
    return int(ctx) if isinstance(ctx, int) else None


def fit_max_new_tokens(
    input_ids: Sequence[list[int]], max_new_tokens: int, context_len: int | None
) -> list[int]:
    """Per prompt, `max_new_tokens` capped to the room its prompt leaves in the context (at
    least 1: a prompt that fills the context alone is left for the engine to reject)."""
    if context_len is None:
        return [max_new_tokens] * len(input_ids)
    return [max(1, min(max_new_tokens, context_len - len(ids))) for ids in input_ids]


def generate_completions(
    engine: Any,
    input_ids: Sequence[list[int]],
    sampling_params: dict[str, Any] | Sequence[dict[str, Any]],
    batch_size: int,
    desc: str = "generate",
) -> list[Completion]:
    """Generate for every prompt, ``batch_size`` prompts per Engine call; a prompt the Engine
    rejects (an error entry in its outputs, or a ValueError for the whole call, e.g. prompt +
    max_new_tokens beyond the context length) becomes an error Completion and the others go on.

    Parameters
    ----------
    input_ids : sequence of list[int]
        One token-id list per prompt (variable lengths).
    sampling_params : dict, or one dict per prompt
        Passed to the ``engine.generate`` calls (fresh copies each time).

    Returns
    -------
    list[Completion]
        In prompt order: the Engine's ``text`` (or its ``output_ids`` decoded without special
        tokens when it returns no text), or the rejection's message.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    shared = sampling_params if isinstance(sampling_params, dict) else None
    params_list: list[dict[str, Any]] = []
    if shared is None:
        params_list = [dict(p) for p in cast(Sequence[dict[str, Any]], sampling_params)]
    if shared is None and len(params_list) != len(input_ids):
        raise ValueError(f"{len(params_list)} sampling_params for {len(input_ids)} prompts")
    done: list[Completion] = []
    # This bar counts every prompt; the Engine's own per-call bar would only add noise.
    extra = {"progress_bar": False} if _accepts(engine.generate, "progress_bar") else {}

    def call(start: int, chunk: list[list[int]]) -> list[Completion]:
        params: Any = dict(shared) if shared is not None else None
        if shared is None:
            params = [dict(p) for p in params_list[start : start + len(chunk)]]
        outs = engine.generate(input_ids=chunk, sampling_params=params, **extra)
        return _completions_of(engine, outs, len(chunk))

    with tqdm(total=len(input_ids), desc=desc, unit="prompt", file=sys.stderr) as bar:
        for start in range(0, len(input_ids), batch_size):
            chunk = [list(ids) for ids in input_ids[start : start + batch_size]]
            try:
                done += call(start, chunk)
            except ValueError:
                # The Engine checks a whole call before running it: retry one by one, so that
                # only the rejected prompts fail.
                for i, ids in enumerate(chunk):
                    try:
                        done += call(start + i, [ids])
                    except ValueError as e:
                        done.append(Completion(None, f"{type(e).__name__}: {e}"))
            for i, c in enumerate(done[start:]):
                if c.error is not None:
                    logger.warning("prompt %d rejected: %s", start + i, c.error)
            bar.update(len(chunk))
    return done


def generate_texts(
    engine: Any,
    input_ids: Sequence[list[int]],
    sampling_params: dict[str, Any],
    batch_size: int,
    desc: str = "generate",
) -> list[str]:
    """`generate_completions` for callers that want every prompt answered: the texts in prompt
    order; a rejected prompt (an error entry or a rejected call) raises ValueError."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    texts: list[str] = []
    extra = {"progress_bar": False} if _accepts(engine.generate, "progress_bar") else {}
    for start in range(0, len(input_ids), batch_size):
        chunk = [list(ids) for ids in input_ids[start : start + batch_size]]
        outs = engine.generate(input_ids=chunk, sampling_params=dict(sampling_params), **extra)
        for i, c in enumerate(_completions_of(engine, outs, len(chunk))):
            if c.text is None:
                raise ValueError(f"prompt {start + i} rejected: {c.error}")
            texts.append(c.text)
    return texts
