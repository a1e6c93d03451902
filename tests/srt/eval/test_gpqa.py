"""GPQA eval: CSV checks, shuffling, prompting, scoring, the JSON line, and end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from srt.eval import gpqa
from srt.eval.engine_io import generate_texts, prompt_token_ids
from srt.eval.multichoice import LETTERS, QUERY_TEMPLATE
from tests.srt.eval.gpqa_fakes import (
    COLUMNS,
    FakeEngine,
    always_a_policy,
    oracle_policy,
    synthetic_rows,
    write_csv,
)

# ---------------------------------------------------------------- CSV loading and errors


def test_load_ok_ignores_extra_columns_and_keeps_quoting(gpqa_csv):
    rows = gpqa.load_gpqa_csv(gpqa_csv(7))
    assert len(rows) == 7
    assert rows[3]["Question"] == 'Question 3: which value, of "x3", is\nright?'
    assert rows[3]["Correct Answer"] == "right-3"


def test_load_bom_and_padded_header(tmp_path):
    path = tmp_path / "bom.csv"
    write_csv(path, synthetic_rows(2))
    text = path.read_text().replace("Question,", " Question ,", 1)
    path.write_text("\ufeff" + text, encoding="utf-8")
    rows = gpqa.load_gpqa_csv(path)
    assert [r["Question"].split(":")[0] for r in rows] == ["Question 0", "Question 1"]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data: GPQA CSV not found"):
        gpqa.load_gpqa_csv(tmp_path / "nope.csv")
    with pytest.raises(FileNotFoundError, match="not found"):
        gpqa.load_gpqa_csv(tmp_path)  # a folder is not a CSV


def test_empty_file(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("")
    with pytest.raises(gpqa.GPQADataError, match="is empty"):
        gpqa.load_gpqa_csv(path)


def test_header_only(tmp_path):
    path = write_csv(tmp_path / "header.csv", [])
    with pytest.raises(gpqa.GPQADataError, match="no data rows"):
        gpqa.load_gpqa_csv(path)


def test_missing_columns(tmp_path):
    cols = [c for c in COLUMNS if c not in ("Incorrect Answer 2", "Question")]
    path = write_csv(tmp_path / "cols.csv", synthetic_rows(3), cols)
    msg = r"lacks GPQA column\(s\) \['Question', 'Incorrect Answer 2'\]"
    with pytest.raises(ValueError, match=msg):
        gpqa.load_gpqa_csv(path)


def test_blank_field(tmp_path):
    rows = synthetic_rows(3)
    rows[2]["Incorrect Answer 3"] = "   "
    path = write_csv(tmp_path / "blank.csv", rows)
    msg = r"data row 3 has blank field\(s\) \['Incorrect Answer 3'\]"
    with pytest.raises(ValueError, match=msg):
        gpqa.load_gpqa_csv(path)


def test_cli_errors(tmp_path, capsys):
    assert gpqa.main(["--load-format", "dummy", "--data", str(tmp_path / "x.csv")]) == 2
    assert "GPQA CSV not found" in capsys.readouterr().err
    empty = tmp_path / "e.csv"
    empty.write_text("")
    assert gpqa.main(["--load-format", "dummy", "--data", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err
    for argv in (
        ["--data", str(empty)],  # neither --model-path nor --load-format dummy
        ["--load-format", "dummy", "--data", str(empty), "--batch-size", "0"],
        ["--load-format", "dummy", "--data", str(empty), "--num-examples", "0"],
        ["--load-format", "dummy", "--data", str(empty), "--temperature", "-1"],
    ):
        with pytest.raises(SystemExit) as exc:
            gpqa.parse_args(argv)
        assert exc.value.code == 2


# ---------------------------------------------------------------- shuffling


def test_shuffle_deterministic_and_valid():
    rows = synthetic_rows(33)
    a = gpqa.build_examples(rows, seed=0)
    b = gpqa.build_examples(rows, seed=0)
    c = gpqa.build_examples(rows, seed=1)
    assert a == b
    assert [e.permutation for e in a] != [e.permutation for e in c]
    for ex in a:
        assert sorted(ex.permutation) == [0, 1, 2, 3]
        row = rows[ex.row]
        # The correct letter points at the correct text; all four texts are shown once.
        assert ex.choices[LETTERS.index(ex.correct_letter)] == row["Correct Answer"]
        assert sorted(ex.choices) == sorted(
            [row["Correct Answer"]] + [row[f"Incorrect Answer {k}"] for k in (1, 2, 3)]
        )
        assert ex.record_id == row["Record ID"]
    # Over 33 questions the correct answer is not always in the same place.
    assert len({ex.correct_letter for ex in a}) > 1


def test_sampling_and_repeats():
    rows = synthetic_rows(33)
    ex = gpqa.build_examples(rows, num_examples=7, num_repeats=3, seed=5)
    assert len(ex) == 21
    first = [e.row for e in ex[:7]]
    assert len(set(first)) == 7 and first != list(range(7))
    assert [e.row for e in ex] == first * 3
    assert [e.repeat for e in ex] == [0] * 7 + [1] * 7 + [2] * 7
    # Each repeat draws a fresh permutation.
    assert [e.permutation for e in ex[:7]] != [e.permutation for e in ex[7:14]]
    assert ex == gpqa.build_examples(rows, num_examples=7, num_repeats=3, seed=5)
    # Asking for more rows than exist takes all of them, in file order.
    assert [e.row for e in gpqa.build_examples(rows[:5], num_examples=100)] == list(range(5))
    with pytest.raises(ValueError, match="num_repeats"):
        gpqa.build_examples(rows, num_repeats=0)


# ---------------------------------------------------------------- prompts


def test_prompt_uses_chat_template(tiny_tokenizer):
    ex = gpqa.build_examples(synthetic_rows(1))[0]
    question = gpqa.format_multichoice_question(ex.question, ex.choices)
    assert question == QUERY_TEMPLATE.format(
        question=ex.question, **dict(zip(LETTERS, ex.choices, strict=True))
    )
    assert question.startswith("Answer the following multiple choice question.")
    assert "'Answer: $LETTER'" in question and question.endswith(f"D) {ex.choices[3]}")
    text, ids = prompt_token_ids(tiny_tokenizer, question)
    assert text == f"<|bos|><|user|>\n{question}<|eos|>\n<|assistant|>\n"
    assert ids[0] == tiny_tokenizer.bos_token_id and ids.count(tiny_tokenizer.bos_token_id) == 1
    assert tiny_tokenizer.decode(ids) == text


def test_prompt_without_chat_template(tiny_tokenizer):
    class Plain:
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
            return {"input_ids": ([99] if add_special_tokens else []) + ids}

    text, ids = prompt_token_ids(Plain(), "What is 1+1?")
    assert text == "What is 1+1?" and ids[0] == 99


# ---------------------------------------------------------------- scoring and the JSON line


def test_score_and_summarize():
    rows = synthetic_rows(4)
    ex = gpqa.build_examples(rows, seed=0)
    responses = [f"Answer: {e.correct_letter}" for e in ex[:3]] + ["no idea"]
    records = gpqa.score_responses(ex, ["p"] * 4, responses)
    assert [r["score"] for r in records] == [1.0, 1.0, 1.0, 0.0]
    assert records[3]["extracted"] is None and records[3]["correct"] == ex[3].correct_letter
    s = gpqa.summarize(records, fused=True)
    assert s["accuracy"] == 0.75 and s["num_examples"] == 4 and s["num_unparsed"] == 1
    assert s["stderr"] == pytest.approx(math.sqrt(0.25 / 4))  # sample var 0.25, n = 4
    assert s["fused"] is True and "agreement" not in s
    unfused = gpqa.score_responses(ex, ["p"] * 4, responses[:2] + ["Answer: Z", "no idea"])
    s = gpqa.summarize(records, fused=True, unfused_records=unfused)
    assert s["unfused_accuracy"] == 0.5 and s["agreement"] == 0.75


def _run(argv, factory, capsys):
    rc = gpqa.main(argv, engine_factory=factory)
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    return json.loads(out[-1])


def test_main_with_fake_engine(gpqa_csv, tiny_tokenizer, tmp_path, capsys):
    engines = []

    def factory(args, fused):
        engines.append(FakeEngine(tiny_tokenizer, oracle_policy, fused))
        return engines[-1]

    out = tmp_path / "sub" / "recs.jsonl"
    argv = ["--load-format", "dummy", "--data", str(gpqa_csv(7)), "--num-repeats", "2"]
    argv += ["--batch-size", "3", "--max-new-tokens", "5", "--seed", "3", "--output", str(out)]
    summary = _run(argv, factory, capsys)
    assert summary["accuracy"] == 1.0 and summary["stderr"] == 0.0
    assert (summary["num_examples"], summary["num_repeats"], summary["num_samples"]) == (7, 2, 14)
    assert summary["fused"] is True and "agreement" not in summary
    # One fused engine, batches of <= 3 prompts, shut down at the end.
    (eng,) = engines
    assert [len(ids) for ids, _ in eng.calls] == [3, 3, 3, 3, 2]
    sp = eng.calls[0][1]
    assert sp == {"max_new_tokens": 5, "temperature": 0.0, "seed": 3}
    assert eng.log[-1] == ("shutdown", True)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 14
    for r in recs:
        assert r["prompt"].startswith("<|bos|><|user|>\nAnswer the following multiple choice")
        assert r["response"].endswith(f"Answer: {r['correct']}")
        assert r["extracted"] == r["correct"] and r["score"] == 1.0 and r["fused"] is True
        assert f"{r['correct']}) right-{r['row']}" in r["prompt"]


def test_compare_unfused_with_fake_engine(gpqa_csv, tiny_tokenizer, tmp_path, capsys):
    log = []

    def policy(prompt, fused):
        # The unfused engine answers "A" on every question: it disagrees where A is wrong.
        return oracle_policy(prompt, fused) if fused else always_a_policy(prompt, fused)

    def factory(args, fused):
        assert not log or log[-1][0] == "shutdown"  # the first engine is gone first
        return FakeEngine(tiny_tokenizer, policy, fused, log)

    out = tmp_path / "recs.jsonl"
    argv = ["--load-format", "dummy", "--data", str(gpqa_csv(9)), "--compare-unfused"]
    argv += ["--output", str(out)]
    summary = _run(argv, factory, capsys)
    assert log == [("start", True), ("shutdown", True), ("start", False), ("shutdown", False)]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    n_a = sum(r["correct"] == "A" for r in recs)
    assert summary["accuracy"] == 1.0
    assert summary["unfused_accuracy"] == pytest.approx(n_a / 9)
    assert summary["agreement"] == 0.0  # the response texts always differ
    assert summary["answer_agreement"] == pytest.approx(n_a / 9)
    assert all(r["unfused_extracted"] == "A" and r["same_response"] is False for r in recs)


def test_engine_shut_down_on_error(gpqa_csv, tiny_tokenizer, capsys):
    log = []

    def boom(prompt, fused):
        raise RuntimeError("kernel failed")

    def factory(args, fused):
        return FakeEngine(tiny_tokenizer, boom, fused, log)

    argv = ["--load-format", "dummy", "--data", str(gpqa_csv(2))]
    with pytest.raises(RuntimeError, match="kernel failed"):
        gpqa.main(argv, engine_factory=factory)
    assert log == [("start", True), ("shutdown", True)]


def test_generate_texts_engine_contract(tiny_tokenizer):
    class IdsOnly:
        """Returns output_ids but no text; takes progress_bar like the real Engine."""

        tokenizer = tiny_tokenizer

        def __init__(self):
            self.calls = []

        def generate(self, input_ids=None, sampling_params=None, progress_bar=None):
            self.calls.append((len(input_ids), progress_bar))
            # Echo each prompt's last two tokens plus EOS (dropped on decode).
            return [{"output_ids": ids[-2:] + [tiny_tokenizer.eos_token_id]} for ids in input_ids]

    eng = IdsOnly()
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ["one two", "three four", "five six"]]
    texts = generate_texts(eng, prompts, {"max_new_tokens": 2}, batch_size=2)
    assert texts == [tiny_tokenizer.decode(p[-2:]) for p in prompts]
    assert eng.calls == [(2, False), (1, False)]

    class Short(IdsOnly):
        def generate(self, input_ids=None, sampling_params=None, progress_bar=None):
            return super().generate(input_ids, sampling_params)[:-1]

    with pytest.raises(RuntimeError, match="1 outputs for 2"):
        generate_texts(Short(), prompts[:2], {}, batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        generate_texts(eng, prompts, {}, batch_size=0)


# ---------------------------------------------------------------- end to end, real Engine


@pytest.mark.parametrize("page_size", [1, 4])
def test_end_to_end_dummy_cpu(gpqa_csv, tmp_path: Path, capsys, page_size):
    out = tmp_path / "e2e.jsonl"
    argv = ["--load-format", "dummy", "--device", "cpu", "--data", str(gpqa_csv(3))]
    argv += ["--max-new-tokens", "4", "--batch-size", "2", "--compare-unfused"]
    argv += ["--dtype", "float32", "--page-size", str(page_size), "--output", str(out)]
    summary = _run(argv, gpqa.make_engine, capsys)
    assert summary["num_examples"] == 3 and summary["num_samples"] == 3
    assert summary["agreement"] == 1.0
    assert summary["accuracy"] == summary["unfused_accuracy"]
    assert summary["fused"] is True
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 3 and all(r["same_response"] for r in recs)
    # accuracy is the share of records whose extracted letter is the correct one
    right = sum(r["extracted"] == r["correct"] for r in recs)
    assert summary["accuracy"] == pytest.approx(right / 3)
    assert all(r["response"] == r["unfused_response"] for r in recs)
    # the shared chat template comes from the prefix cache after the first batch
    assert summary["num_cached_tokens"] > 0 and recs[2]["cached_tokens"] > 0
    assert summary["num_prompt_tokens"] == sum(r["prompt_tokens"] for r in recs)
    hit = summary["num_cached_tokens"] / summary["num_prompt_tokens"]
    assert summary["cache_hit_rate"] == pytest.approx(hit, abs=1e-4)


def test_end_to_end_disable_radix_cache_reports_no_cached_tokens(gpqa_csv, capsys):
    argv = ["--load-format", "dummy", "--device", "cpu", "--data", str(gpqa_csv(3))]
    argv += ["--max-new-tokens", "2", "--batch-size", "2", "--disable-radix-cache"]
    summary = _run(argv, gpqa.make_engine, capsys)
    assert summary["num_prompt_tokens"] > 0
    assert summary["num_cached_tokens"] == 0 and summary["cache_hit_rate"] == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_end_to_end_dummy_cuda(gpqa_csv, tmp_path: Path, capsys, kv_cache_dtype):
    # Fused and unfused write the same cache bits, so greedy outputs agree exactly (CUDA graphs on).
    argv = ["--load-format", "dummy", "--device", "cuda", "--data", str(gpqa_csv(5))]
    argv += ["--max-new-tokens", "8", "--batch-size", "3", "--compare-unfused"]
    argv += ["--dtype", "bfloat16", "--kv-cache-dtype", kv_cache_dtype, "--page-size", "16"]
    summary = _run(argv, gpqa.make_engine, capsys)
    assert summary["num_samples"] == 5 and summary["agreement"] == 1.0
    assert summary["num_cached_tokens"] > 0  # the shared template, from the prefix cache
    assert summary["accuracy"] == summary["unfused_accuracy"]
