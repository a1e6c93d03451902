"""Multiple-choice prompting, answer extraction and scoring (the simple-evals conventions).

The prompt asks for a last line ``Answer: $LETTER``; :func:`extract_choice_letter` finds the
letter in what models actually write (``**Answer:** (C)``, ``Answer: $\\boxed{C}$``,
``The answer is C.``, a bare ``C`` on the last line, ...), preferring the explicit form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

LETTERS = "ABCD"

QUERY_TEMPLATE = (
    "Answer the following multiple choice question. The last line of your response should be "
    "of the following format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. "
    "Think step by step before answering.\n"
    "\n"
    "{question}\n"
    "\n"
    "A) {A}\n"
    "B) {B}\n"
    "C) {C}\n"
    "D) {D}"
)

# A choice letter: upper case only (a lower-case "a" is usually the article), not followed by
# another word character ("Answer: Because ..." names no letter).
_LETTER = r"([A-D])(?![A-Za-z0-9_])"
# What may sit between the marker and the letter: markdown emphasis, quotes, math delimiters,
# an opening bracket, and one LaTeX wrapper such as \boxed{ or \text{.
_WRAP = r"[\s*_`'\"$]*(?:\\(?:boxed|text|textbf|mathrm|mathbf)\s*\{)?[\s(\[{]*"
_OPTION = r"(?:(?i:option|choice)\s*)?"

# Tier 1: "Answer: X" (also "**Answer:** X", "Final answer: X", "ANSWER：X").
_EXPLICIT = re.compile(r"(?i:answer)[ \t*_]*[:：]" + _WRAP + _OPTION + _LETTER)
# Tier 2: "the answer is X" / "answer is: (X)".
_ANSWER_IS = re.compile(r"(?i:answer)\s+(?i:is)\s*:?" + _WRAP + _OPTION + _LETTER)
# Tier 3: "\boxed{X}".
_BOXED = re.compile(r"\\boxed\s*\{\s*(?:\\text(?:bf)?\s*\{\s*)?" + _LETTER)
# Tier 4: a last line that is only the letter, e.g. "C", "(C)", "**C.**".
_BARE_LINE = re.compile(r"^[\s*_`'\"$(\[{]*([A-D])[\s*_`'\"$)\]}.:]*$")


def format_multichoice_question(question: str, choices: Sequence[str]) -> str:
    """The simple-evals multiple-choice prompt for ``question`` and ``choices`` in A..D order."""
    if len(choices) != len(LETTERS):
        raise ValueError(f"choices must have {len(LETTERS)} entries, got {len(choices)}")
    return QUERY_TEMPLATE.format(question=question, **dict(zip(LETTERS, choices, strict=True)))


def extract_choice_letter(response: str) -> str | None:
    """The letter (``"A"``..``"D"``) a response chose, or None when it names none.

    Tiers are tried in order and the last match of the first tier that matches wins, so a
    final ``Answer: D`` overrides an ``Answer: A`` quoted earlier in the reasoning.
    """
    for pattern in (_EXPLICIT, _ANSWER_IS, _BOXED):
        matches = pattern.findall(response)
        if matches:
            return matches[-1]
    lines = [line for line in response.splitlines() if line.strip()]
    if lines:
        match = _BARE_LINE.match(lines[-1])
        if match:
            return match.group(1)
    return None


def mean_and_stderr(scores: Sequence[float]) -> tuple[float, float]:
    """Mean of ``scores`` and its standard error (sample std, ddof=1, over sqrt(n)).

    Returns ``(nan, nan)`` for no scores and a stderr of 0.0 for a single one.
    """
    n = len(scores)
    if n == 0:
        return math.nan, math.nan
    mean = sum(scores) / n
    if n == 1:
        return mean, 0.0
    var = sum((s - mean) ** 2 for s in scores) / (n - 1)
    return mean, math.sqrt(var / n)
