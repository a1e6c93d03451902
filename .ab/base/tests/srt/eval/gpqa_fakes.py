"""Test helpers for the eval tests: synthetic GPQA rows/CSV and a scriptable fake Engine."""

from __future__ import annotations

import csv
import re
from pathlib import Path

COLUMNS = [
    "Record ID",
    "Question",
    "Correct Answer",
    "Incorrect Answer 1",
    "Incorrect Answer 2",
    "Incorrect Answer 3",
    "Subdomain",
]


def synthetic_rows(n: int) -> list[dict[str, str]]:
    """``n`` made-up questions; the correct answer is marked "right-<i>" so a fake can find it."""
    rows = []
    for i in range(n):
        rows.append(
            {
                "Record ID": f"rec{i:03d}",
                # Commas, quotes and a newline exercise CSV quoting.
                "Question": f'Question {i}: which value, of "x{i}", is\nright?',
                "Correct Answer": f"right-{i}",
                "Incorrect Answer 1": f"wrong-{i}-1",
                "Incorrect Answer 2": f"wrong-{i}-2",
                "Incorrect Answer 3": f"wrong-{i}-3",
                "Subdomain": "Synthetic",
            }
        )
    return rows


def write_csv(path: Path, rows: list[dict[str, str]], columns: list[str] | None = None) -> Path:
    columns = columns or COLUMNS
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


class FakeEngine:
    """The Engine surface the eval uses. ``policy(prompt_text) -> response text``.

    Records every generate call and whether it was shut down.
    """

    def __init__(self, tokenizer, policy, fused: bool = True, log: list | None = None):
        self.tokenizer = tokenizer
        self.policy = policy
        self.fused = fused
        self.calls: list[tuple[list[list[int]], dict]] = []
        self.log = log if log is not None else []
        self.log.append(("start", fused))

    def generate(self, prompt=None, input_ids=None, sampling_params=None, return_logprob=False):
        assert prompt is None and input_ids is not None
        self.calls.append((input_ids, sampling_params))
        outs = []
        for ids in input_ids:
            text = self.policy(self.tokenizer.decode(ids), self.fused)
            out_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            outs.append({"text": text, "output_ids": out_ids})
        return outs

    def shutdown(self):
        self.log.append(("shutdown", self.fused))


def oracle_policy(prompt: str, fused: bool) -> str:
    """Answers right: finds the letter whose choice text starts with "right-"."""
    letter = re.search(r"^([A-D])\) right-", prompt, re.M).group(1)
    return f"Thinking...\nAnswer: {letter}"


def always_a_policy(prompt: str, fused: bool) -> str:
    return "The answer is A."
