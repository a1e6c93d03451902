"""GPQA fails loudly: rejected prompts are error rows (never wrong answers), a run where every
request fails exits non-zero, the default --max-new-tokens fits the context, and what would
fail after the run (an --output that cannot be written) is refused before it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from srt.eval import gpqa
from srt.eval.engine_io import fit_max_new_tokens, generate_completions, generate_texts
from tests.srt.eval.gpqa_fakes import FakeEngine, oracle_policy, synthetic_rows, write_csv


def _last_json(capsys) -> tuple[dict, str]:
    cap = capsys.readouterr()
    return json.loads(cap.out.strip().splitlines()[-1]), cap.err


class ErrorEntryEngine(FakeEngine):
    """Like the real Engine with a list: a rejected prompt gets an error entry, others run."""

    def __init__(self, *args, reject=lambda text: "TOO LONG" in text, **kwargs):
        super().__init__(*args, **kwargs)
        self.reject = reject

    def generate(self, prompt=None, input_ids=None, sampling_params=None, return_logprob=False):
        outs = super().generate(prompt, input_ids, sampling_params, return_logprob)
        for i, ids in enumerate(input_ids):
            if self.reject(self.tokenizer.decode(ids)):
                outs[i] = {"output_ids": [], "text": "", "error": "exceeds the context length 64"}
        return outs


class WithContext(ErrorEntryEngine):
    """A stand-in that reports its context length, as the Engine's model runner does."""

    class model_runner:  # noqa: N801 - the Engine's attribute name
        context_len = 300


def _data(tmp_path: Path, n: int, marks: dict[int, str]) -> Path:
    rows = synthetic_rows(n)
    for i, mark in marks.items():
        rows[i]["Question"] += f" {mark}"
    return write_csv(tmp_path / "q.csv", rows)


def test_error_entries_are_error_rows(tmp_path, tiny_tokenizer, capsys):
    data = _data(tmp_path, 5, {1: "TOO LONG", 4: "TOO LONG"})
    out = tmp_path / "recs.jsonl"

    def factory(args, fused):
        return ErrorEntryEngine(tiny_tokenizer, oracle_policy, fused)

    argv = ["--load-format", "dummy", "--data", str(data), "--max-new-tokens", "8"]
    assert gpqa.main(argv + ["--output", str(out)], engine_factory=factory) == 0
    summary, err = _last_json(capsys)
    assert summary["num_errors"] == 2 and summary["num_unparsed"] == 0
    assert summary["accuracy"] == pytest.approx(3 / 5)
    assert "2 of 5 requests failed" in err
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["row"] for r in recs if r["error"]] == [1, 4]
    assert all(r["response"] is None for r in recs if r["error"])


def test_every_request_failing_exits_non_zero(tmp_path, tiny_tokenizer, capsys):
    def factory(args, fused):
        return ErrorEntryEngine(tiny_tokenizer, oracle_policy, fused, reject=lambda t: True)

    argv = ["--load-format", "dummy", "--data", str(_data(tmp_path, 3, {}))]
    assert gpqa.main(argv, engine_factory=factory) == 1
    summary, err = _last_json(capsys)
    assert summary["num_errors"] == summary["num_samples"] == 3 and summary["accuracy"] == 0.0
    assert err.strip().splitlines()[-1].startswith("error: every request failed (")
    assert "exceeds the context length 64" in summary["first_error"]


def test_default_max_new_tokens_fits_each_prompt(tmp_path, tiny_tokenizer, capsys):
    engines = []

    def factory(args, fused):
        engines.append(WithContext(tiny_tokenizer, oracle_policy, fused))
        return engines[-1]

    argv = ["--load-format", "dummy", "--data", str(_data(tmp_path, 4, {}))]
    assert gpqa.main(argv, engine_factory=factory) == 0
    summary, err = _last_json(capsys)
    assert summary["num_errors"] == 0 and summary["accuracy"] == 1.0
    (ids, params), *_ = engines[0].calls
    assert [p["max_new_tokens"] for p in params] == [300 - len(x) for x in ids]
    assert "capped to the room each prompt leaves in the 300-token context" in err


def test_fit_max_new_tokens():
    assert fit_max_new_tokens([[1] * 10, [1] * 99, [1] * 200], 50, 100) == [50, 1, 1]
    assert fit_max_new_tokens([[1] * 10], 50, None) == [50]
    assert gpqa.remote_max_new_tokens(2048)[0] == 1024
    assert gpqa.remote_max_new_tokens(131072)[0] == gpqa.remote_max_new_tokens(None)[0] == 2048


def test_engine_io_reads_error_entries(tiny_tokenizer):
    eng = ErrorEntryEngine(tiny_tokenizer, lambda prompt, fused: "Answer: A")
    ids = [tiny_tokenizer(t)["input_ids"] for t in ["short", "TOO LONG"]]
    done = generate_completions(eng, ids, {"max_new_tokens": 4}, batch_size=2)
    assert done[0].error is None and done[0].text.endswith("Answer: A")
    assert done[1].text is None and "exceeds the context length" in done[1].error
    with pytest.raises(ValueError, match="prompt 1 rejected"):
        generate_texts(eng, ids, {"max_new_tokens": 4}, batch_size=2)


def test_engine_io_step_failure_is_an_error_row(monkeypatch):
    """The real Engine (tiny model, CPU): a prompt whose forward rows raise fails alone inside
    a step; engine_io makes it an error row naming the failure (not a ValueError, not a text
    to score) and the others keep their solo texts."""
    import srt

    eng = srt.Engine(device="cpu", max_total_tokens=512)
    try:
        sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        prompts = [[5, 6, 7], [1000, 4, 4], [8, 9]]
        solo = [eng.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
        sched, runner = eng.scheduler, eng.model_runner
        real = runner.forward

        def forward(fb):
            rows = set(fb.req_pool_indices.tolist())
            if any(r.origin_input_ids[0] == 1000 and r.req_pool_idx in rows for r in sched.running):
                raise RuntimeError("poisoned row")
            return real(fb)

        monkeypatch.setattr(runner, "forward", forward)
        done = generate_completions(eng, prompts, sp, batch_size=3)
        assert done[1].text is None
        assert done[1].error == "failed inside the engine: RuntimeError: poisoned row"
        texts = [eng.tokenizer.decode(ids, skip_special_tokens=True) for ids in solo]
        assert [done[0].text, done[2].text] == [texts[0], texts[2]]
        with pytest.raises(ValueError, match="prompt 1 rejected: failed inside the engine"):
            generate_texts(eng, prompts, sp, batch_size=3)
    finally:
        eng.shutdown()


def test_question_over_the_context_with_the_real_engine(tmp_path, capsys):
    """The real Engine (tiny model, CPU): a question beyond the context is an error row."""
    rows = synthetic_rows(3)
    rows[1]["Question"] = " ".join(["word"] * 3000)
    data = write_csv(tmp_path / "long.csv", rows)
    out = tmp_path / "recs.jsonl"
    argv = ["--load-format", "dummy", "--device", "cpu", "--data", str(data)]
    argv += ["--max-new-tokens", "3", "--output", str(out)]
    assert gpqa.main(argv) == 0
    summary, _ = _last_json(capsys)
    assert summary["num_errors"] == 1 and summary["num_samples"] == 3
    (bad,) = [json.loads(x) for x in out.read_text().splitlines() if '"error": null' not in x]
    assert bad["row"] == 1 and "exceeds the context length" in bad["error"]


def test_long_csv_fields_load(tmp_path):
    rows = synthetic_rows(2)
    rows[0]["Question"] = "x" * 200_000
    loaded = gpqa.load_gpqa_csv(write_csv(tmp_path / "big.csv", rows))
    assert len(loaded[0]["Question"]) == 200_000
    assert csv.field_size_limit() == 131072  # the process-wide limit is left as it was


def _error(argv, capsys, factory=None) -> str:
    def never(args, fused):
        raise AssertionError("the run started")

    assert gpqa.main(argv, engine_factory=factory or never) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_output_path_checked_before_the_run(tmp_path, capsys):
    data = str(write_csv(tmp_path / "a.csv", synthetic_rows(2)))
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    base = ["--load-format", "dummy", "--data", data, "--output"]
    line = _error(base + [str(blocker / "sub" / "out.jsonl")], capsys)
    assert line == (
        f"error: --output cannot be created: {blocker} is a file, not a folder "
        f"({blocker / 'sub' / 'out.jsonl'})"
    )
    line = _error(base + [str(tmp_path)], capsys)
    assert line == f"error: --output is a directory, not a file ({tmp_path})"


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_bad_temperature(tmp_path, capsys, value):
    data = str(write_csv(tmp_path / "a.csv", synthetic_rows(2)))
    line = _error(["--load-format", "dummy", "--data", data, "--temperature", value], capsys)
    assert line.startswith("error: --temperature must be a finite number >= 0")
