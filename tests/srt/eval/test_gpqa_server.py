"""`python -m srt.eval.gpqa --base-url ...` as the README runs it, against our own server (the
embedded tiny model, in process, on a loopback port): real numbers, or a clear failure."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="install the server extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="install the server extra (fastapi, uvicorn)")

import srt  # noqa: E402
from srt.entrypoints.http_server import ServerThread  # noqa: E402
from srt.eval import gpqa  # noqa: E402
from tests.srt.eval.gpqa_fakes import synthetic_rows, write_csv  # noqa: E402

CONTEXT = 512


@pytest.fixture(scope="module")
def server():
    eng = srt.Engine(
        device="cpu", context_length=CONTEXT, max_total_tokens=4096, enable_cache_report=True
    )
    if eng.tokenizer is None:
        eng.shutdown()
        pytest.skip("tiny tokenizer not shipped")
    st = ServerThread(eng)
    yield st
    st.close()
    eng.shutdown()


def test_readme_command_reports_real_numbers(server, tmp_path, capsys):
    data = write_csv(tmp_path / "gpqa.csv", synthetic_rows(3))
    out = tmp_path / "recs.jsonl"
    argv = ["--base-url", server.url + "/v1", "--data", str(data), "--output", str(out)]
    assert gpqa.main([*argv, "--batch-size", "1"]) == 0
    cap = capsys.readouterr()
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["num_samples"] == 3 and summary["num_errors"] == 0
    assert 0.0 <= summary["accuracy"] <= 1.0
    # No --max-new-tokens: half of the context /v1/models reports, and said so.
    assert f"256 (half the server's {CONTEXT}-token context)" in cap.err
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(isinstance(r["response"], str) and r["error"] is None for r in recs)
    # --enable-cache-report: one question at a time, the later ones reuse the chat template
    assert summary["num_cached_tokens"] > 0 and recs[-1]["cached_tokens"] > 0
    assert summary["num_prompt_tokens"] == sum(r["prompt_tokens"] for r in recs)


def test_every_question_rejected_is_a_clear_failure(server, tmp_path, capsys):
    data = write_csv(tmp_path / "gpqa.csv", synthetic_rows(2))
    argv = ["--base-url", server.url + "/v1", "--data", str(data), "--max-new-tokens", "600"]
    assert gpqa.main(argv) == 1
    cap = capsys.readouterr()
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["num_errors"] == summary["num_samples"] == 2 and summary["accuracy"] == 0.0
    last = cap.err.strip().splitlines()[-1]
    assert last.startswith("error: every request failed (HTTP 400: ")
    assert f"exceeds the context length {CONTEXT}" in last
