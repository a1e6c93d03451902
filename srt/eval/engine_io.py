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
from typing import Any

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One prompt's outcome: its text, or the error that rejected it (then text is None)."""

    text: str | None
    error: str | None = None


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


def _texts_of(engine: Any, outputs: Any, n: int) -> list[str]:
    if isinstance(outputs, dict):  # a single request may come back unwrapped
        outputs = [outputs]
    if len(outputs) != n:
        raise RuntimeError(f"engine returned {len(outputs)} outputs for {n}")
    texts = []
    for out in outputs:
        text = out.get("text")
        if text is None:
            text = engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
        texts.append(text)
    return texts


def generate_completions(
    engine: Any,
    input_ids: Sequence[list[int]],
    sampling_params: dict[str, Any],
    batch_size: int,
    desc: str = "generate",
) -> list[Completion]:
    """Generate for every prompt, ``batch_size`` prompts per Engine call; a prompt the Engine
    rejects (a ValueError, e.g. prompt + max_new_tokens beyond the context length) becomes an
    error Completion and the others go on.

    Parameters
    ----------
    input_ids : sequence of list[int]
        One token-id list per prompt (variable lengths).
    sampling_params : dict
        Passed to every ``engine.generate`` call (a fresh copy each time).

    Returns
    -------
    list[Completion]
        In prompt order: the Engine's ``text`` (or its ``output_ids`` decoded without special
        tokens when it returns no text), or the rejection's message.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    done: list[Completion] = []
    # This bar counts every prompt; the Engine's own per-call bar would only add noise.
    extra = {"progress_bar": False} if _accepts(engine.generate, "progress_bar") else {}

    def call(chunk: list[list[int]]) -> list[str]:
        outs = engine.generate(input_ids=chunk, sampling_params=dict(sampling_params), **extra)
        return _texts_of(engine, outs, len(chunk))

    with tqdm(total=len(input_ids), desc=desc, unit="prompt", file=sys.stderr) as bar:
        for start in range(0, len(input_ids), batch_size):
            chunk = [list(ids) for ids in input_ids[start : start + batch_size]]
            try:
                done += [Completion(t) for t in call(chunk)]
            except ValueError:
                # The Engine checks a whole call before running it: retry one by one, so that
                # only the rejected prompts fail.
                for i, ids in enumerate(chunk):
                    try:
                        done.append(Completion(call([ids])[0]))
                    except ValueError as e:
                        logger.warning("prompt %d rejected: %s", start + i, e)
                        done.append(Completion(None, f"{type(e).__name__}: {e}"))
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
    order; a rejected prompt raises its ValueError."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    texts: list[str] = []
    extra = {"progress_bar": False} if _accepts(engine.generate, "progress_bar") else {}
    for start in range(0, len(input_ids), batch_size):
        chunk = [list(ids) for ids in input_ids[start : start + batch_size]]
        outs = engine.generate(input_ids=chunk, sampling_params=dict(sampling_params), **extra)
        texts += _texts_of(engine, outs, len(chunk))
    return texts
