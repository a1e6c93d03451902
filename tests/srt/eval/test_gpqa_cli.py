"""GPQA command line: rejected questions become error rows, --base-url against a fake
OpenAI-compatible server, and the one-line errors (exit status 2)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from srt.eval import gpqa
from tests.srt.eval.fake_openai_server import CONTEXT_ERROR, MODEL, FakeOpenAIServer
from tests.srt.eval.gpqa_fakes import FakeEngine, oracle_policy, synthetic_rows, write_csv

ROOT = Path(__file__).resolve().parents[3]


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _rows_with(tmp_path: Path, n: int, marks: dict[int, str]) -> Path:
    rows = synthetic_rows(n)
    for i, mark in marks.items():
        rows[i]["Question"] += f" {mark}"
    return write_csv(tmp_path / "marked.csv", rows)


# ---------------------------------------------------------------- over-long questions


class RejectingEngine(FakeEngine):
    """Rejects a whole generate call (before running it, like the Engine's context check) when
    one of its prompts says TOO LONG."""

    def generate(self, prompt=None, input_ids=None, sampling_params=None, return_logprob=False):
        texts = [self.tokenizer.decode(ids) for ids in input_ids]
        if any("TOO LONG" in t for t in texts):
            raise ValueError("prompt 4000 + max_new_tokens 2048 exceeds the context length 2048")
        return super().generate(prompt, input_ids, sampling_params, return_logprob)


def test_overlong_question_is_an_error_row(tmp_path, tiny_tokenizer, capsys):
    data = _rows_with(tmp_path, 7, {2: "TOO LONG"})
    engines = []

    def factory(args, fused):
        engines.append(RejectingEngine(tiny_tokenizer, oracle_policy, fused))
        return engines[-1]

    out = tmp_path / "recs.jsonl"
    argv = ["--load-format", "dummy", "--data", str(data), "--batch-size", "3"]
    assert gpqa.main(argv + ["--output", str(out)], engine_factory=factory) == 0
    summary = _summary(capsys)
    assert summary["num_errors"] == 1 and summary["num_samples"] == 7
    assert summary["accuracy"] == pytest.approx(6 / 7) and summary["num_unparsed"] == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    bad = [r for r in recs if r["error"]]
    assert [r["row"] for r in bad] == [2]
    assert "exceeds the context length" in bad[0]["error"] and bad[0]["score"] == 0.0
    assert bad[0]["response"] is None and bad[0]["extracted"] is None
    assert all(r["score"] == 1.0 for r in recs if not r["error"])
    # The rejected batch of 3 was retried one prompt at a time (rejected calls run nothing and
    # are not recorded): [1, 1] of the first batch, then [3] and [1]; then shut down.
    assert [len(ids) for ids, _ in engines[0].calls] == [1, 1, 3, 1]
    assert engines[0].log[-1] == ("shutdown", True)


# ---------------------------------------------------------------- --base-url


def test_base_url_against_fake_server(tmp_path, capsys):
    data = _rows_with(tmp_path, 5, {1: "TOO LONG", 3: "FLAKY"})
    out = tmp_path / "remote.jsonl"
    with FakeOpenAIServer() as srv:
        argv = ["--base-url", srv.base_url, "--data", str(data), "--batch-size", "2"]
        argv += ["--max-new-tokens", "16", "--seed", "5", "--request-timeout", "20"]
        assert gpqa.main(argv + ["--output", str(out)]) == 0
        reqs = list(srv.requests)
    summary = _summary(capsys)
    assert summary["num_samples"] == 5 and summary["num_errors"] == 1
    assert summary["accuracy"] == pytest.approx(4 / 5)
    assert len(reqs) == 6  # 5 questions + one retry of the FLAKY one after its HTTP 500
    assert {r["model"] for r in reqs} == {MODEL}  # asked GET /models for the name
    assert all(r["max_tokens"] == 16 and r["temperature"] == 0.0 and r["seed"] == 5 for r in reqs)
    assert all(r["messages"][0]["content"].startswith("Answer the following") for r in reqs)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    (bad,) = [r for r in recs if r["error"]]
    assert bad["row"] == 1 and bad["error"] == f"HTTP 400: {CONTEXT_ERROR}"


def test_base_url_model_flag(tmp_path, capsys):
    with FakeOpenAIServer() as srv:
        argv = ["--base-url", srv.base_url + "/", "--model", "my-name", "--data"]
        assert gpqa.main(argv + [str(write_csv(tmp_path / "a.csv", synthetic_rows(2)))]) == 0
        assert {r["model"] for r in srv.requests} == {"my-name"}
    assert _summary(capsys)["accuracy"] == 1.0


def test_base_url_unreachable_one_line(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = write_csv(tmp_path / "a.csv", synthetic_rows(2))
    argv = ["--base-url", f"http://127.0.0.1:{port}/v1", "--data", str(data)]
    assert gpqa.main(argv + ["--request-timeout", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: cannot reach the OpenAI-compatible server: ")
    assert err[0].endswith(f"(http://127.0.0.1:{port}/v1/models)")


# ---------------------------------------------------------------- one-line errors


def _error(argv, capsys) -> str:
    assert gpqa.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_non_utf8_csv(tmp_path, capsys):
    path = tmp_path / "latin1.csv"
    write_csv(path, synthetic_rows(2))
    path.write_bytes(path.read_bytes().replace(b"right-1", "right-\xe9".encode("latin-1")))
    line = _error(["--load-format", "dummy", "--data", str(path)], capsys)
    assert line.startswith("error: --data is not UTF-8 text: byte 0xe9 at offset ")
    assert line.endswith(f"re-save it as UTF-8 ({path})")


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (
            ["--model-path", "/no/such/ckpt"],
            "error: --model-path: no such directory (/no/such/ckpt)",
        ),
        (
            [],
            "error: give --model-path, --load-format dummy for the embedded tiny model, "
            "or --base-url",
        ),
        (
            ["--base-url", "http://x/v1", "--compare-unfused"],
            "error: --compare-unfused needs the offline engine, not --base-url",
        ),
        (["--load-format", "dummy", "--page-size", "0"], "error: --page-size must be >= 1 (0)"),
        (
            ["--base-url", "localhost:30000/v1"],
            "error: --base-url must start with http:// or https:// (localhost:30000/v1)",
        ),
    ],
)
def test_one_line_errors(extra, line, gpqa_csv, capsys):
    assert _error(["--data", str(gpqa_csv(2))] + extra, capsys) == line


def test_model_path_without_config(tmp_path, gpqa_csv, capsys):
    line = _error(["--data", str(gpqa_csv(2)), "--model-path", str(tmp_path)], capsys)
    assert line == f"error: --model-path has no config.json: not an HF checkpoint ({tmp_path})"


def test_bad_dtype(gpqa_csv, capsys):
    line = _error(["--data", str(gpqa_csv(2)), "--load-format", "dummy", "--dtype", "x"], capsys)
    assert line.startswith("error: argument --dtype: invalid choice: 'x'")


def test_subprocess_one_line(tmp_path):
    """As a user sees it: no traceback, one line, exit 2; --help shows the defaults."""
    env_path = str(ROOT)
    cmd = [sys.executable, "-m", "srt.eval.gpqa", "--data", str(tmp_path / "none.csv")]
    out = subprocess.run(
        cmd + ["--load-format", "dummy"],
        cwd=tmp_path,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr == f"error: --data: GPQA CSV not found: {tmp_path / 'none.csv'}\n"
    helped = subprocess.run(
        [sys.executable, "-m", "srt.eval.gpqa", "--help"],
        cwd=tmp_path,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    words = " ".join(helped.stdout.split())
    assert helped.returncode == 0 and "(default: 2048, capped to fit the context)" in words
    assert "the context) (default: None)" not in words
    assert "--base-url" in helped.stdout and "--debug" in helped.stdout
