"""The GPQA data: the public CSV schema, its loading and checks, and the shuffled examples.

``Question``, ``Correct Answer``, ``Incorrect Answer 1..3`` (other columns are ignored); one
``random.Random(seed)`` first samples rows, then draws a permutation of the four choices for
every (row, repeat), as openai/simple-evals does.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from srt.eval.multichoice import LETTERS

QUESTION = "Question"
CORRECT = "Correct Answer"
INCORRECT = ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
REQUIRED_COLUMNS = (QUESTION, CORRECT, *INCORRECT)
# The largest CSV field read (csv's own default limit, 131072 characters, is below the longest
# questions some GPQA-style files hold).
CSV_FIELD_LIMIT = 2**30


class GPQADataError(ValueError):
    """The ``--data`` CSV is empty, lacks a GPQA column, or has a blank required field."""


@dataclass(frozen=True)
class GPQAExample:
    """One (question, repeat) with its choices in the order shown to the model."""

    row: int  # 0-based data row in the CSV
    repeat: int
    question: str
    choices: tuple[str, str, str, str]  # display order A..D
    permutation: tuple[int, int, int, int]  # choices[i] = original[permutation[i]], 0 = correct
    correct_letter: str
    record_id: str | None = None


def load_gpqa_csv(path: str | Path) -> list[dict[str, str]]:
    """Read a GPQA CSV and check its schema.

    Raises
    ------
    FileNotFoundError
        ``path`` is not a file.
    GPQADataError
        (a ValueError) The file is empty, lacks a required column, has no data rows, or a
        row leaves a required field blank.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data: GPQA CSV not found: {path}")
    # utf-8-sig: tolerate a byte-order mark in front of the header.
    old_limit = csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                raise GPQADataError(f"--data: {path} is empty (no header row)")
            header = [name.strip() for name in reader.fieldnames]
            missing = [c for c in REQUIRED_COLUMNS if c not in header]
            if missing:
                raise GPQADataError(
                    f"--data: {path} lacks GPQA column(s) {missing}; it has {header}. "
                    f"Required: {list(REQUIRED_COLUMNS)}"
                )
            reader.fieldnames = header
            rows = list(reader)
    except UnicodeDecodeError as e:
        raise GPQADataError(
            f"--data is not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start}; "
            f"re-save it as UTF-8 ({path})"
        ) from None
    except csv.Error as e:
        raise GPQADataError(f"--data is not a readable CSV: {e} ({path})") from None
    finally:
        csv.field_size_limit(old_limit)
    if not rows:
        raise GPQADataError(f"--data: {path} has a header but no data rows")
    for i, row in enumerate(rows):
        blank = [c for c in REQUIRED_COLUMNS if not (row.get(c) or "").strip()]
        if blank:
            raise GPQADataError(f"--data: {path} data row {i + 1} has blank field(s) {blank}")
    return rows


def build_examples(
    rows: Sequence[dict[str, str]],
    num_examples: int | None = None,
    num_repeats: int = 1,
    seed: int = 0,
) -> list[GPQAExample]:
    """Sample, repeat and shuffle choices (simple-evals order of RNG draws).

    Returns ``len(selected rows) * num_repeats`` examples, row-major in repeat order
    (all rows of repeat 0, then of repeat 1, ...). Deterministic in ``seed``.
    """
    if num_examples is not None and num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    if num_repeats < 1:
        raise ValueError(f"num_repeats must be >= 1, got {num_repeats}")
    rng = random.Random(seed)
    indices = list(range(len(rows)))
    if num_examples is not None and num_examples < len(rows):
        indices = rng.sample(indices, num_examples)
    examples = []
    for repeat in range(num_repeats):
        for i in indices:
            row = rows[i]
            original = (row[CORRECT], *(row[c] for c in INCORRECT))
            p0, p1, p2, p3 = rng.sample(range(4), 4)
            perm = (p0, p1, p2, p3)
            examples.append(
                GPQAExample(
                    row=i,
                    repeat=repeat,
                    question=row[QUESTION],
                    choices=(original[p0], original[p1], original[p2], original[p3]),
                    permutation=perm,
                    correct_letter=LETTERS[perm.index(0)],
                    record_id=row.get("Record ID") or None,
                )
            )
    return examples


__all__ = [
    "CORRECT",
    "INCORRECT",
    "QUESTION",
    "REQUIRED_COLUMNS",
    "GPQADataError",
    "GPQAExample",
    "build_examples",
    "load_gpqa_csv",
]
