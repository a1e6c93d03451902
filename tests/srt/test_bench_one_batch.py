"""python -m srt.bench_one_batch: runs with no flags, SGLang's flags and result rows, exit codes,
the correctness test, and the one-line errors of every user mistake."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_ext import settings as sgl_ext_settings
from srt import bench_one_batch, settings
from srt.bench_one_batch import cli_main, main

ROOT = Path(__file__).resolve().parents[2]
SGLANG_FIELDS = {
    "run_name",
    "batch_size",
    "input_len",
    "output_len",
    "prefill_latency",
    "prefill_throughput",
    "median_decode_latency",
    "median_decode_throughput",
    "total_latency",
    "overall_throughput",
}
CPU = ["--device", "cpu", "--log-level", "warning"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_no_flags_subprocess(tmp_path):
    """The README's main job, exactly as a user runs it (tiny model, CPU here); by default it
    appends SGLang-style rows to ./result.jsonl."""
    out = subprocess.run(
        [sys.executable, "-m", "srt.bench_one_batch", "--json-out", str(tmp_path / "r.json")],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("output tokens: MATCH"), out.stdout
    assert any("prefill" in x and "tok/s" in x and "floor" in x for x in lines)
    assert "loading " in out.stderr and "parameters" in out.stderr  # the loading message
    data = json.loads((tmp_path / "r.json").read_text())
    variants = {(r["variant"], r["batch_size"]) for r in data["results"]}
    assert variants == {("fused", 1), ("fused", 8), ("unfused", 1), ("unfused", 8)}
    for r in data["results"]:
        assert r["decode_tokens_per_s"] > 0 and len(r["output_ids"]) == r["batch_size"]
        assert all(len(o) == r["output_len"] for o in r["output_ids"])
        assert 0 < r["median_prepare_latency"] < 1.0  # the step's batch preparation, seconds
    rows = [json.loads(x) for x in (tmp_path / "result.jsonl").read_text().splitlines()]
    # one row per timed variant: 4 on CPU, 8 on CUDA (eager and graph rows)
    assert len(rows) == len(data["results"]) and all(SGLANG_FIELDS <= set(r) for r in rows)
    assert all(r["run_name"] == "default" and r["tokens_match"] for r in rows)


def test_flags_paged_fp8(capsys, tmp_path):
    res = tmp_path / "res.jsonl"
    res.write_text('{"earlier": 1}\n')
    results = main(
        ["--batch-size", "3", "--input-len", "7", "--output-len", "5", "--page-size", "4"]
        + ["--kv-cache-dtype", "fp8_e4m3", "--result-filename", str(res), "--run-name", "x"]
        + CPU
    )
    assert len(results) == 2 and all(r["passed"] for r in results)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("output tokens: MATCH")
    assert any("floor" in x and "n/a" in x for x in out)  # no floor on the CPU
    rows = [json.loads(x) for x in res.read_text().splitlines()]
    assert rows[0] == {"earlier": 1} and len(rows) == 3  # appended, as SGLang does
    assert {r["run_name"] for r in rows[1:]} == {"x"} and rows[1]["decode_floor_latency"] is None
    only_unfused = main(
        ["--batch-size", "1", "--input-len", "4", "--output-len", "2", "--disable-fused-rope-kv"]
        + ["--result-filename", ""]
        + CPU
    )
    assert [r["variant"] for r in only_unfused] == ["unfused"]


def test_length_lists_and_warmup(monkeypatch, capsys):
    """--input-len/--output-len take lists (all combinations, SGLang's order) and every
    (batch size, input length) shape is warmed up before it is timed."""
    calls = []
    real = bench_one_batch.run_batch

    def spy(runner, bs, il, ol, use_graph, seed, trace_path=None):
        calls.append((bs, il, ol))
        return real(runner, bs, il, ol, use_graph, seed, trace_path)

    monkeypatch.setattr(bench_one_batch, "run_batch", spy)
    results = main(
        ["--batch-size", "1", "2", "--input-len", "3", "5", "--output-len", "2", "6"]
        + ["--disable-fused-rope-kv", "--result-filename", ""]
        + CPU
    )
    shapes = [(r["batch_size"], r["input_len"], r["output_len"]) for r in results]
    assert shapes == [(b, i, o) for b in (1, 2) for i in (3, 5) for o in (2, 6)]
    # One untimed warm-up run per (batch size, input length), right before its first timed run.
    expected = [c for b in (1, 2) for i in (3, 5) for c in [(b, i, 2), (b, i, 2), (b, i, 6)]]
    assert calls == expected
    assert all(r["prefill_throughput"] > 0 for r in results)


def test_mismatch_exits_nonzero(monkeypatch, capsys):
    """A variant whose tokens differ: MISMATCH line and exit status 1."""
    real = bench_one_batch.run_batch

    def corrupt(runner, bs, il, ol, use_graph, seed, trace_path=None):
        r = real(runner, bs, il, ol, use_graph, seed, trace_path)
        if not runner.server_args.enable_fused_rope_kv:
            r["output_ids"][0][-1] += 1
        return r

    monkeypatch.setattr(bench_one_batch, "run_batch", corrupt)
    argv = ["--batch-size", "2", "--input-len", "4", "--output-len", "3", "--result-filename", ""]
    assert cli_main(argv + CPU) == 1
    assert "output tokens: MISMATCH" in capsys.readouterr().out


def test_correctness_test(capsys):
    rows = main(["--correctness-test", "--output-len", "4", "--cut-len", "3"] + CPU)
    out = capsys.readouterr().out
    assert "input_ids=" in out and "========== Prompt 2 ==========" in out
    assert "prefill logits (final)" in out and "correctness test: PASSED" in out
    assert {r["path"] for r in rows} == {"whole", "cut3"} and all(r["passed"] for r in rows)
    assert len({json.dumps(r["output_ids"]) for r in rows if r["path"] == "whole"}) == 1
    assert all(r["logits_max_rel_diff"] < 1e-3 for r in rows if r["path"] == "cut3")


def test_profile_writes_trace(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path))
    argv = ["--batch-size", "1", "--input-len", "3", "--output-len", "4", "--profile"]
    try:  # SGLANG_TORCH_PROFILER_DIR read through srt's settings
        settings.reload()
        main(argv + ["--disable-fused-rope-kv", "--result-filename", ""] + CPU)
    finally:
        monkeypatch.undo()
        settings.reload()
    traces = list(tmp_path.glob("profile_unfused_graph0_batch1_input3_output4_decode.trace.json*"))
    assert len(traces) == 1, list(tmp_path.iterdir())
    raw = traces[0].read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    assert data["traceEvents"]
    assert "torch profiler trace" in capsys.readouterr().out


def test_help_shows_every_flag_with_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--correctness-test",
        "--cut-len",
        "--run-name",
        "--result-filename",
        "--tp-size",
        "--cuda-graph-max-bs",
        "--mem-fraction-static",
        "--context-length",
        "--profile",
        "--debug",
    ):
        assert flag in text
    assert "(default: result.jsonl)" in text and "(default: [128])" in text
    parser = bench_one_batch.build_parser()
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]


# ---------------------------------------------------------------- one-line errors, exit 2


def _error(argv, capsys, monkeypatch=None) -> str:
    code = cli_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--model-path", "/no/such/dir"], "error: --model-path: no such directory (/no/such/dir)"),
        (["--page-size", "0"], "error: --page-size must be >= 1 (0)"),
        (["--batch-size", "2", "0"], "error: --batch-size must be >= 1 (0)"),
        (["--output-len", "-1"], "error: --output-len must be >= 1 (-1)"),
        (["--mem-fraction-static", "1.5"], "error: --mem-fraction-static must be in (0, 1] (1.5)"),
        (
            ["--input-len", "3000"],
            "error: --input-len + --output-len exceeds the model's context length 2048 "
            "(3000 + 32 = 3032)",
        ),
        (
            ["--input-len", "100", "--context-length", "64"],
            "error: --input-len + --output-len exceeds --context-length 64 (100 + 32 = 132)",
        ),
        (
            ["--correctness-test", "--cut-len", "50"],
            "error: --cut-len must be shorter than every prompt (11 tokens) (50)",
        ),
    ],
)
def test_one_line_errors(argv, line, capsys):
    assert _error(argv + CPU, capsys) == line


def test_bad_dtype_one_line(capsys):
    line = _error(["--dtype", "float8"] + CPU, capsys)
    assert line.startswith("error: argument --dtype: invalid choice: 'float8'")


def test_model_path_without_config(tmp_path, capsys):
    line = _error(["--model-path", str(tmp_path)] + CPU, capsys)
    assert line == f"error: --model-path has no config.json: not an HF checkpoint ({tmp_path})"
    bad = tmp_path / "config.json"
    bad.write_bytes(b"\xff\xfe not json")
    assert _error(["--model-path", str(tmp_path)] + CPU, capsys).startswith("error: ")


def test_triton_on_cpu_needs_interpreter(monkeypatch, capsys):
    with sgl_ext_settings.override(interpret=False):  # TRITON_INTERPRET unset
        line = _error(["--attention-backend", "triton"] + CPU, capsys)
    assert "TRITON_INTERPRET=1" in line and line.endswith("(triton)")


def test_tp_size_needs_torchrun(monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    line = _error(["--tp-size", "2"] + CPU, capsys)
    assert "torchrun --nproc-per-node 2" in line and line.endswith("(2)")


def test_preset_too_big_for_memory_fails_before_allocating(monkeypatch, capsys):
    """--model-preset llama3-8b on a small CPU box: one line, nothing allocated."""
    from srt.model_loader import loader, weight_memory

    monkeypatch.setattr(weight_memory, "available_memory", lambda device: 4 << 30)

    def no_alloc(*a, **k):
        raise AssertionError("the model was allocated despite the memory check")

    monkeypatch.setattr(loader, "get_model", no_alloc)
    line = _error(["--model-preset", "llama3-8b"] + CPU, capsys)
    assert line.startswith("error: not enough memory for a 32-layer, 4096-wide model")
    assert "8.03 B parameters in float32" in line
    assert line.endswith("(29.9 GiB needed, 4.0 GiB available)")


def test_hub_id_offline_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    from srt.model_loader.hub import resolve_model_path

    resolve_model_path.cache_clear()
    with settings.override(hf_hub_offline=True):  # HF_HUB_OFFLINE=1
        line = _error(["--model-path", "no-org/no-model-x"] + CPU, capsys)
    assert line == (
        "error: --model-path is not a local directory and the Hub id is not in the local cache "
        "while HF_HUB_OFFLINE=1 (no-org/no-model-x)"
    )


def test_debug_shows_traceback(capsys):
    assert cli_main(["--model-path", "/no/such/dir", "--debug"] + CPU) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: --model-path")


def test_one_line_error_subprocess(tmp_path):
    """As a user sees it: exit status 2, one stderr line, no traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "srt.bench_one_batch", "--page-size", "0"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr == "error: --page-size must be >= 1 (0)\n"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_floor_graph_and_correctness(tmp_path, capsys):
    """GPU: the floor column is printed and positive, graph/eager/fused/unfused tokens match,
    and the correctness test passes with CUDA graphs."""
    res = tmp_path / "r.jsonl"
    argv = ["--batch-size", "1", "4", "--input-len", "16", "33", "--output-len", "8"]
    results = main(argv + ["--device", "cuda", "--result-filename", str(res)])
    assert all(r["passed"] for r in results)
    assert {r["cuda_graph"] for r in results} == {False, True}
    assert all(r["decode_floor_latency"] and r["decode_floor_latency"] > 0 for r in results)
    assert all(r["copy_bandwidth"] > 1e11 for r in results)  # > 100 GB/s on any datacenter GPU
    rows = main(["--correctness-test", "--device", "cuda", "--output-len", "8"])
    assert all(r["passed"] for r in rows) and {r["cuda_graph"] for r in rows} == {False, True}
