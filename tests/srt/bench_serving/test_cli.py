"""python -m srt.bench_serving end to end on the embedded tiny model (CPU): the engine backend
(prefix-cache hit rate > 0 on shared prefixes, 0 with --disable-radix-cache, fixed output
lengths, the jsonl row), the long-prompt scenario, the openai backend against srt's own HTTP
server in-process, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from srt.bench_serving.cli import cli_main, main

ROOT = Path(__file__).resolve().parents[3]
CPU = ["--device", "cpu", "--disable-tqdm"]
GSP = [
    "--dataset-name",
    "generated-shared-prefix",
    "--gsp-num-groups",
    "3",
    "--gsp-prompts-per-group",
    "3",
    "--gsp-system-prompt-len",
    "37",
    "--gsp-question-len",
    "5",
    "--gsp-output-len",
    "6",
    "--max-concurrency",
    "2",  # a group's later requests arrive after its first one is cached
]
SGLANG_KEYS = {
    "backend",
    "dataset_name",
    "request_rate",
    "max_concurrency",
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "total_throughput",
    "mean_e2e_latency_ms",
    "median_e2e_latency_ms",
    "p99_e2e_latency_ms",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "concurrency",
    "cache_report",
}


def _check_fixed_lengths(row, output_len):
    outs = row["outputs"]
    assert all(o.success for o in outs), [o.error for o in outs]
    assert all(o.output_len == output_len for o in outs)
    assert all(1 <= len(o.token_times) <= output_len for o in outs)
    assert all(o.ttft > 0 and o.latency >= o.ttft for o in outs)


def test_engine_shared_prefix_cache_on_and_off(tmp_path):
    out = tmp_path / "serving.jsonl"
    on = main([*CPU, *GSP, "--output-file", str(out), "--tag", "on"])
    off = main([*CPU, *GSP, "--output-file", str(out), "--disable-radix-cache"])
    for row in (on, off):
        assert row["completed"] == 9 and row["failed"] == 0
        assert row["total_input_tokens"] == 9 * 42
        _check_fixed_lengths(row, 6)
    assert on["cache_hit_rate"] > 0 and on["cache_report"]["total_cached_tokens"] > 0
    assert off["cache_hit_rate"] == 0.0 and off["cache_report"]["total_cached_tokens"] == 0
    assert on["server_info"]["disable_radix_cache"] is False
    assert off["server_info"]["disable_radix_cache"] is True
    lines = out.read_text().splitlines()
    assert len(lines) == 2  # one line per run, appended
    first = json.loads(lines[0])
    assert SGLANG_KEYS <= set(first)
    assert first["tag"] == "on" and first["gsp_num_groups"] == 3
    assert "outputs" not in first and "itls" not in first


def test_engine_random_rate_and_details(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    plot = tmp_path / "lat.svg"
    args = [*CPU, "--num-prompts", "6", "--random-input-len", "20", "--random-output-len", "5"]
    args += ["--random-range-ratio", "1", "--request-rate", "200", "--output-details"]
    args += ["--output-file", str(out), "--plot", str(plot), "--seed", "3"]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Median TTFT (ms):" in text
    row = json.loads(out.read_text())
    assert row["request_rate"] == 200 and row["completed"] == 6
    assert row["input_lens"] == [20] * 6 and row["output_lens"] == [5] * 6
    assert len(row["itls"]) == 6 and all(len(x) <= 4 for x in row["itls"])
    assert plot.exists() and plot.stat().st_size > 0


def test_engine_long_prompt_arrival():
    row = main(
        [
            *CPU,
            "--dataset-name",
            "long-prompt-arrival",
            "--lpa-decoders",
            "3",
            "--lpa-decoder-input-len",
            "9",
            "--lpa-decoder-output-len",
            "24",
            "--lpa-long-len",
            "300",
            "--lpa-long-output-len",
            "2",
            "--lpa-delay-s",
            "0.05",
            "--chunked-prefill-size",
            "64",
            "--warmup-requests",
            "0",
        ]
    )
    assert row["completed"] == 4 and row["server_info"]["chunked_prefill_size"] == 64
    assert row["lpa_decoder_itl_median_ms"] > 0
    assert row["lpa_itl_p99_over_median"] == pytest.approx(
        row["lpa_decoder_itl_p99_ms"] / row["lpa_decoder_itl_median_ms"]
    )
    long = [o for o in row["outputs"] if o.role == "long"]
    assert len(long) == 1 and long[0].prompt_len == 300 and long[0].output_len == 2


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tests.srt.entrypoints.server_harness import start_server, stop_server

    st = start_server({"enable_cache_report": True, "page_size": 4})
    yield st
    stop_server(st)


def test_openai_backend_against_our_server(server, tmp_path):
    url = f"http://{server.host}:{server.port}"
    out = tmp_path / "o.jsonl"
    row = main([*CPU, *GSP, "--backend", "openai", "--base-url", url, "--flush-cache"])
    assert row["completed"] == 9
    _check_fixed_lengths(row, 6)
    assert row["server_info"]["model"] == "tiny"  # the first of /v1/models
    # usage.prompt_tokens_details.cached_tokens: whole 4-token pages of the 37-token prefix
    assert row["cache_hit_rate"] > 0
    cached = [o.cached_tokens for o in row["outputs"]]
    assert all(c is not None and c % 4 == 0 for c in cached)
    # the /v1 prefix form of the URL works too; random prompts share nothing
    args = [*CPU, "--backend", "openai", "--base-url", url + "/v1", "--model", "tiny"]
    args += ["--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "3"]
    rnd = main([*args, "--output-file", str(out)])
    assert rnd["completed"] == 4 and rnd["cache_hit_rate"] == 0.0
    assert SGLANG_KEYS <= set(json.loads(out.read_text()))


def test_openai_failed_requests_exit_1(server, capsys):
    url = f"http://{server.host}:{server.port}"
    args = [*CPU, "--backend", "openai", "--base-url", url, "--num-prompts", "2"]
    args += ["--random-input-len", "5000", "--random-output-len", "2", "--random-range-ratio", "1"]
    assert cli_main([*args, "--warmup-requests", "0"]) == 1  # longer than the server's context
    assert "2 requests failed; the first: HTTPError: HTTP 400" in capsys.readouterr().out
    assert cli_main(args) == 2  # the warm-up's failure: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: a warm-up request failed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
        (["--backend", "openai"], "--backend openai needs --base-url"),
        (["--backend", "openai", "--base-url", "localhost:1"], "http://"),
        (["--base-url", "http://x"], "--base-url is for --backend openai"),
        (["--dataset-name", "sharegpt"], "invalid choice"),
        (["--lpa-delay-s", "inf"], "--lpa-delay-s"),
        (["--model-preset", "llama3-8b", "--model-path", "/x"], "exclude each other"),
        (["--output-file", "/nonexistent/dir/r.jsonl"], "--output-file"),
        (["--context-length", "8", "--random-input-len", "16"], "--context-length"),
        (["--gsp-output-len", "-1"], "--gsp-output-len"),
    ],
)
def test_cli_errors_one_line_exit_2(argv, words, capsys):
    # (argparse keeps the last --num-prompts: the case's own wins over the small default)
    assert cli_main([*CPU, "--num-prompts", "2", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_unreachable_server_is_one_line(capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    assert cli_main([*CPU, "--backend", "openai", "--base-url", url, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot reach --base-url"), err


def test_module_entry_point():
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    out = subprocess.run(
        [sys.executable, "-m", "srt.bench_serving", "--request-rate", "-1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --request-rate must be > 0 (inf: all at once) (-1.0)"
    ]


def test_context_length_raised_past_a_config_without_context_len():
    """A preset's ModelConfig has max_position_embeddings only (no context_len): a request
    longer than it still raises the engine's context length (the 32k long-prompt run)."""
    from types import SimpleNamespace

    from srt.bench_serving.cli import context_length
    from srt.bench_serving.datasets import DatasetRow

    rows = [DatasetRow(prompt=[1] * 300, output_len=8)]
    args = SimpleNamespace(context_length=None)
    assert context_length(args, SimpleNamespace(max_position_embeddings=256), rows) == 308
    assert context_length(args, SimpleNamespace(max_position_embeddings=4096), rows) is None
    assert context_length(args, SimpleNamespace(context_len=128), rows) == 308
