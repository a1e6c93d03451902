"""Answer extraction and the accuracy statistics."""

from __future__ import annotations

import math

import pytest

from srt.eval.multichoice import extract_choice_letter, format_multichoice_question, mean_and_stderr


@pytest.mark.parametrize(
    "response, letter",
    [
        ("Answer: C", "C"),
        ("reasoning...\nAnswer: B", "B"),
        ("answer:d", None),  # lower-case letters are not choices
        ("ANSWER: D", "D"),
        ("Answer:A", "A"),
        ("Answer: (C)", "C"),
        ("Answer: [B].", "B"),
        ("**Answer:** C", "C"),
        ("**Answer**: D", "D"),
        ("**Answer: A**", "A"),
        ("Final Answer: B", "B"),
        ("Answer: $\\boxed{C}$", "C"),
        ("Answer: \\boxed{\\text{D}}", "D"),
        ("Answer: C) 42 J", "C"),
        ("Answer: option B", "B"),
        ("Answer：A", "A"),  # full-width colon
        ("First I thought Answer: A. But no.\nAnswer: D", "D"),  # the last one wins
        ("The answer is B.", "B"),
        ("So the correct answer is (A) because ...", "A"),
        ("Thus the final result is \\boxed{C}.", "C"),
        ("Let me think.\n\n(B)", "B"),
        ("Let me think.\n**C.**\n\n", "C"),
        ("Answer: $LETTER", None),  # echoing the instruction names no letter
        ("Answer: Because the field is zero.", None),
        # "A" then a space reads as the choice; an article cannot be told apart from it.
        ("Answer: A photon is absorbed", "A"),
        ("An answer is hard", None),
        ("The best answer would be E", None),
        ("", None),
        ("ABCD", None),
    ],
)
def test_extract(response, letter):
    assert extract_choice_letter(response) == letter


def test_explicit_beats_fallbacks():
    assert extract_choice_letter("The answer is B.\nAnswer: C\n\nA") == "C"
    assert extract_choice_letter("\\boxed{A} so the answer is D") == "D"


def test_format_needs_four_choices():
    with pytest.raises(ValueError, match="choices must have 4"):
        format_multichoice_question("q", ["a", "b", "c"])


def test_mean_and_stderr():
    m, s = mean_and_stderr([1.0, 0.0, 1.0, 1.0, 0.0])
    assert m == pytest.approx(0.6)
    assert s == pytest.approx(math.sqrt(0.3 / 5))  # sample variance 0.3
    assert mean_and_stderr([1.0]) == (1.0, 0.0)
    m, s = mean_and_stderr([])
    assert math.isnan(m) and math.isnan(s)
