"""``python -m srt.bench_one_batch --correctness-test``: decode real prompts and check them.

SGLang's meaning of the flag: instead of timing random prompts, tokenize a few real prompts,
prefill the first ``--cut-len`` tokens of each, extend with the rest, greedy-decode
``--output-len`` tokens and print the final prefill logits and the texts. Our ScheduleBatch has
no prefix-extend step, so "the rest" is fed one token at a time through decode steps, which
also checks the decode path against the prefill path. Checks (any failure: exit status 1):

- every variant (fused / unfused, eager / CUDA graph) produces the same tokens as the first;
- the logits after the last prompt token agree between the whole-prompt prefill and the
  cut-then-decode path within the dtype's tolerance (relative to the largest logit; not checked
  with an fp8 KV cache, whose rounding the decode path sees and the prefill path does not).

The embedded model has random weights: its text is not meant to read well.
"""

from __future__ import annotations

import argparse
import copy
import gc
from dataclasses import dataclass
from typing import Any

import torch

from srt.bench_args import build_server_args, check_lengths
from srt.utils.cli import CLIError

# SGLang's default correctness-test prompts.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "The capital of the United Kindom is",
    "Today is a sunny day and I like",
)
# Max |cut - whole| / max |whole| of the final prefill logits, by model dtype.
LOGITS_RTOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Generation:
    """One pass over the prompts: the logits after the last prompt token and the new tokens."""

    final_logits: torch.Tensor  # float64 [B, V] on the CPU
    output_ids: list[list[int]]  # [B][output_len]


def _tokenizer(args: argparse.Namespace) -> Any:
    if args.model_path is not None:
        from srt.model_loader.loader import load_tokenizer

        return load_tokenizer(args.model_path)
    if args.model_preset is None:
        from srt.assets import load_tiny_tokenizer

        return load_tiny_tokenizer()
    return None  # a preset's vocabulary has no tokenizer here


def prompt_ids(args: argparse.Namespace, tokenizer: Any, vocab: int) -> list[list[int]]:
    """The default prompts tokenized, or seeded random ids of similar lengths without one."""
    if tokenizer is not None:
        return [list(tokenizer.encode(p)) for p in DEFAULT_PROMPTS]
    g = torch.Generator().manual_seed(args.seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 9, 10)]


def generate(
    runner: Any, input_ids: list[list[int]], output_len: int, use_graph: bool, cut: int | None
) -> Generation:
    """Greedy generation; ``cut``: prefill that many tokens, then feed the rest by decode steps."""
    from srt.managers.schedule_batch import Req, ScheduleBatch
    from srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    n_first = [len(ids) if cut is None else cut for ids in input_ids]
    reqs = [
        Req(i, ids[:n], params) for i, (ids, n) in enumerate(zip(input_ids, n_first, strict=True))
    ]
    sb = ScheduleBatch.from_runner(runner)
    final: dict[int, torch.Tensor] = {}  # request index -> float64 [V] last-prompt logits
    try:
        logits = runner.forward(sb.prepare_for_extend(reqs))  # [B, V]
        for i, r in enumerate(reqs):
            if r.kv_len == len(input_ids[i]):
                final[i] = logits[i].double().cpu()
        while True:  # feed the rest of each prompt, one token per decode step
            active = [i for i, r in enumerate(reqs) if r.kv_len < len(input_ids[i])]
            if not active:
                break
            for i in active:
                reqs[i].output_ids = [input_ids[i][reqs[i].kv_len]]
            logits = runner.forward(sb.prepare_for_decode([reqs[i] for i in active]), use_graph)
            for row, i in enumerate(active):
                if reqs[i].kv_len == len(input_ids[i]):
                    final[i] = logits[row].double().cpu()
        stacked = torch.stack([final[i] for i in range(len(reqs))])  # float64 [B, V]
        ids = stacked.argmax(dim=-1).tolist()
        outputs = [[t] for t in ids]
        for _ in range(output_len - 1):
            for r, t in zip(reqs, ids, strict=True):
                r.output_ids = [t]
            ids = runner.greedy_ids(runner.forward(sb.prepare_for_decode(reqs), use_graph))
            for out, t in zip(outputs, ids, strict=True):
                out.append(t)
    finally:
        for r in reqs:
            sb.free_req(r)
    return Generation(stacked, outputs)


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def correctness_test(args: argparse.Namespace, model_config: Any) -> list[dict[str, Any]]:
    """Run the check for every variant; print logits and texts; return one row per variant and
    path, each with ``passed``."""
    from srt.model_executor.model_runner import ModelRunner

    tokenizer = _tokenizer(args)
    input_ids = prompt_ids(args, tokenizer, int(model_config.vocab_size))
    lens = [len(x) for x in input_ids]
    if args.cut_len >= min(lens):
        raise CLIError(
            f"--cut-len must be shorter than every prompt ({min(lens)} tokens)", args.cut_len
        )
    check_lengths(model_config, args, lens)
    output_len = args.output_len[0]
    pool_args = copy.copy(args)
    pool_args.batch_size = [len(input_ids)]
    print(f"input_ids={input_ids}\n", flush=True)
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    model = None
    for fused in [False] if args.disable_fused_rope_kv else [True, False]:
        sargs = build_server_args(pool_args, fused, max_len=max(lens) + output_len)
        runner = ModelRunner(sargs, model_config, model)
        model, model_config = runner.model, runner.model_config
        graph_modes = [False] + ([True] if runner.cuda_graph_runner is not None else [])
        name = "fused" if fused else "unfused"
        rtol = None if runner.kv_dtype.itemsize == 1 else LOGITS_RTOL[runner.dtype]
        for use_graph in graph_modes:
            whole = generate(runner, input_ids, output_len, use_graph, cut=None)
            cut = generate(runner, input_ids, output_len, use_graph, cut=args.cut_len)
            diff = _rel_diff(cut.final_logits, whole.final_logits)
            reference = whole.output_ids if reference is None else reference
            same = whole.output_ids == reference
            close = rtol is None or diff <= rtol
            tag = f"{name} graph={int(use_graph)}"
            print(f"[{tag}] prefill logits (final): {whole.final_logits.float()}\n")
            print(
                f"[{tag}] cut-len {args.cut_len} + decode vs whole prefill: max rel diff of "
                f"the final logits {diff:.2e} (tolerance {rtol if rtol else 'n/a (fp8 KV)'}): "
                f"{'OK' if close else 'TOO LARGE'}; tokens "
                f"{'equal' if cut.output_ids == whole.output_ids else 'differ'}"
            )
            for i, (ids, out) in enumerate(zip(input_ids, whole.output_ids, strict=True)):
                text = tokenizer.decode(ids + out) if tokenizer is not None else ids + out
                print(f"========== Prompt {i} ==========\n{text}\n", flush=True)
            common = {"variant": name, "cuda_graph": use_graph, "batch_size": len(input_ids)}
            rows.append({**common, "path": "whole", "output_ids": whole.output_ids, "passed": same})
            rows.append(
                {
                    **common,
                    "path": f"cut{args.cut_len}",
                    "output_ids": cut.output_ids,
                    "logits_max_rel_diff": diff,
                    "passed": close,
                }
            )
        runner.cuda_graph_runner = None
        del runner
        gc.collect()
    failed = [
        f"{r['variant']}/graph={int(r['cuda_graph'])}/{r['path']}" for r in rows if not r["passed"]
    ]
    if failed:
        print(f"correctness test: FAILED ({', '.join(failed)})")
    else:
        print("correctness test: PASSED (tokens match across variants, logits within tolerance)")
    return rows
