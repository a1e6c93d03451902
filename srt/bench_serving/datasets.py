"""The request lists of ``python -m srt.bench_serving``: prompts as token ids, no tokenizer.

SGLang's two synthetic datasets, with its length rules:
- ``random``: each prompt's length is drawn uniformly from [max(int(L * ratio), 1), L] (L the
  input length, ratio ``--random-range-ratio``), its output length likewise; ids uniform over
  the vocabulary.
- ``generated-shared-prefix``: ``num_groups`` system prompts, each shared by its group's
  ``prompts_per_group`` requests (the same ids, so a prefix cache can reuse them), each request
  its own question after it; fixed lengths; the requests shuffled.
And one of ours (issue 48's chunked-prefill scenario), ``long-prompt-arrival``: decoders that
start together, then one long prompt arriving while they decode (`long_prompt.py` measures
them).

Every generator takes a seed and draws from its own numpy Generator: the same arguments give
the same rows, and no global random state is read or changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROLE_DECODER = "decoder"
ROLE_LONG = "long"


@dataclass(frozen=True)
class DatasetRow:
    """One request of a benchmark.

    Attributes
    ----------
    prompt : the prompt's token ids.
    output_len : tokens to generate (exactly: the benchmark ignores EOS).
    group : the shared-prefix group (generated-shared-prefix), else -1.
    role : long-prompt-arrival's ``"decoder"`` or ``"long"``, else "".
    arrival_s : seconds after the start at which the request is sent; None: by the request
        rate (Poisson arrivals, or all at once).
    """

    prompt: tuple[int, ...]
    output_len: int
    group: int = -1
    role: str = ""
    arrival_s: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def _check(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def random_lens(full_len: int, range_ratio: float, num: int, rng: np.random.Generator) -> list[int]:
    """``num`` lengths uniform in [max(int(full_len * range_ratio), 1), full_len] (SGLang's
    rule; ratio 1 gives full_len every time)."""
    _check("full_len", full_len)
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    low = max(int(full_len * range_ratio), 1)
    return [int(x) for x in rng.integers(low, full_len + 1, size=num)]


def _ids(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, vocab_size, size=n))


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
) -> list[DatasetRow]:
    """SGLang's ``random`` dataset: random ids, lengths by `random_lens`."""
    _check("num_prompts", num_prompts)
    _check("vocab_size", vocab_size)
    rng = np.random.default_rng(seed)
    in_lens = random_lens(input_len, range_ratio, num_prompts, rng)
    out_lens = random_lens(output_len, range_ratio, num_prompts, rng)
    return [
        DatasetRow(_ids(rng, n_in, vocab_size), n_out)
        for n_in, n_out in zip(in_lens, out_lens, strict=True)
    ]


def sample_generated_shared_prefix(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    shuffle: bool = True,
) -> list[DatasetRow]:
    """SGLang's ``generated-shared-prefix`` dataset: group g's requests are its system prompt
    (identical ids across the group) followed by a question of their own; shuffled unless
    ``shuffle`` is False (then group-major)."""
    for name, v in (
        ("num_groups", num_groups),
        ("prompts_per_group", prompts_per_group),
        ("system_prompt_len", system_prompt_len),
        ("question_len", question_len),
        ("output_len", output_len),
        ("vocab_size", vocab_size),
    ):
        _check(name, v)
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(num_groups):
        system = _ids(rng, system_prompt_len, vocab_size)
        for _ in range(prompts_per_group):
            rows.append(DatasetRow(system + _ids(rng, question_len, vocab_size), output_len, g))
    if shuffle:
        order = rng.permutation(len(rows))
        rows = [rows[i] for i in order]
    return rows


def sample_long_prompt_arrival(
    num_decoders: int,
    decoder_input_len: int,
    decoder_output_len: int,
    long_len: int,
    long_output_len: int,
    delay_s: float,
    vocab_size: int,
    seed: int,
) -> list[DatasetRow]:
    """Issue 48's chunked-prefill scenario: ``num_decoders`` requests sent at once, then one
    prompt of ``long_len`` tokens sent ``delay_s`` seconds later, while they decode (the
    decoders' output should outlast the long prompt's prefill)."""
    for name, v in (
        ("num_decoders", num_decoders),
        ("decoder_input_len", decoder_input_len),
        ("decoder_output_len", decoder_output_len),
        ("long_len", long_len),
        ("long_output_len", long_output_len),
        ("vocab_size", vocab_size),
    ):
        _check(name, v)
    if not delay_s >= 0.0:
        raise ValueError(f"delay_s must be >= 0, got {delay_s}")
    rng = np.random.default_rng(seed)
    rows = [
        DatasetRow(
            _ids(rng, decoder_input_len, vocab_size), decoder_output_len, -1, ROLE_DECODER, 0.0
        )
        for _ in range(num_decoders)
    ]
    rows.append(
        DatasetRow(_ids(rng, long_len, vocab_size), long_output_len, -1, ROLE_LONG, delay_s)
    )
    return rows


def warmup_rows(rows: list[DatasetRow], count: int, vocab_size: int, seed: int) -> list[DatasetRow]:
    """``count`` warm-up requests shaped like the first rows (and like the longest prompt, so
    its kernels are compiled too), with fresh ids that share nothing with the dataset and at
    most 4 output tokens each."""
    if count <= 0 or not rows:
        return []
    rng = np.random.default_rng(seed + 1_000_003)
    shapes = [r.prompt_len for r in rows[:count]]
    longest = max(r.prompt_len for r in rows)
    if longest not in shapes:
        shapes.append(longest)
    return [DatasetRow(_ids(rng, n, vocab_size), min(4, rows[0].output_len)) for n in shapes]


__all__ = [
    "ROLE_DECODER",
    "ROLE_LONG",
    "DatasetRow",
    "random_lens",
    "sample_generated_shared_prefix",
    "sample_long_prompt_arrival",
    "sample_random_requests",
    "warmup_rows",
]
