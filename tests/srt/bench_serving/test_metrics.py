"""srt.bench_serving's metric math on synthetic timestamps against hand-computed values, the
long-prompt scenario's decoder ITL, the report, the jsonl row and the picture."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest

from srt.bench_serving.datasets import ROLE_DECODER, ROLE_LONG
from srt.bench_serving.long_prompt import format_long_prompt, long_prompt_metrics
from srt.bench_serving.metrics import Distribution, RequestOutput, calculate_metrics
from srt.bench_serving.plot import plot_latency, svg_histograms
from srt.bench_serving.report import append_jsonl, check_writable, format_report


def _req(start, times, end, out_len, prompt, cached=None, ok=True, role=""):
    return RequestOutput(
        prompt_len=prompt,
        output_len=out_len,
        start_time=start,
        end_time=end,
        token_times=list(times),
        cached_tokens=cached,
        success=ok,
        role=role,
    )


def _synthetic() -> list[RequestOutput]:
    return [
        _req(0.0, [0.10, 0.15, 0.25], 0.25, 3, 10, cached=4),
        _req(0.05, [0.25, 0.30], 0.30, 2, 20, cached=0),
        _req(0.0, [], 0.40, 0, 99, cached=50, ok=False),  # failed: counted as failed only
    ]


def test_metrics_by_hand():
    m = calculate_metrics(_synthetic(), duration=0.5)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input, m.total_output, m.total_cached) == (30, 5, 4)
    assert m.request_throughput == pytest.approx(4.0)
    assert m.input_throughput == pytest.approx(60.0)
    assert m.output_throughput == pytest.approx(10.0)
    assert m.total_throughput == pytest.approx(70.0)
    assert m.concurrency == pytest.approx(1.0)  # (0.25 + 0.25) / 0.5
    assert m.cache_hit_rate == pytest.approx(4 / 30)
    # TTFT 100, 200 ms: p99 by linear interpolation = 100 + 0.99 * 100
    assert (m.ttft.mean, m.ttft.median, m.ttft.p99, m.ttft.max) == pytest.approx(
        (150.0, 150.0, 199.0, 200.0)
    )
    assert m.ttft.std == pytest.approx(50.0)
    # ITL 50, 100 (first request), 50 (second): sorted [50, 50, 100], p99 at 1.98 -> 99
    assert (m.itl.mean, m.itl.median, m.itl.p99, m.itl.max) == pytest.approx(
        (200 / 3, 50.0, 99.0, 100.0)
    )
    # TPOT (0.25 - 0.10) / 2 = 75 ms, (0.25 - 0.20) / 1 = 50 ms
    assert (m.tpot.mean, m.tpot.median) == pytest.approx((62.5, 62.5))
    assert (m.e2e_latency.mean, m.e2e_latency.p99) == pytest.approx((250.0, 250.0))
    row = m.as_row()
    for key in (
        "completed",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "total_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mean_e2e_latency_ms",
        "median_e2e_latency_ms",
        "p99_e2e_latency_ms",
        "concurrency",
    ):
        assert key in row
    assert row["cache_report"] == {
        "total_prompt_tokens": 30,
        "total_cached_tokens": 4,
        "cache_hit_rate_pct": 13.33,
    }


def test_single_token_requests_and_unreported_cache():
    outs = [_req(0.0, [0.2], 0.2, 1, 8), _req(0.0, [0.3], 0.3, 1, 8)]
    m = calculate_metrics(outs, 1.0)
    assert m.tpot == Distribution.of_seconds([]) and m.itl.p99 == 0.0  # SGLang: zeros
    assert m.cache_hit_rate is None and m.total_cached is None
    assert m.as_row()["cache_report"]["cache_hit_rate_pct"] is None
    assert "n/a" in "\n".join(format_report(m, {"Backend:": "openai"}))
    with pytest.raises(ValueError, match="duration"):
        calculate_metrics(outs, 0.0)


def test_report_lines():
    m = calculate_metrics(_synthetic(), duration=0.5)
    lines = format_report(m, {"Backend:": "engine", "Traffic request rate:": "inf"})
    text = "\n".join(lines)
    assert lines[0].strip("=").strip() == "Serving Benchmark Result"
    for label, value in (
        ("Request throughput (req/s):", "4.00"),
        ("Median ITL (ms):", "50.00"),
        ("P99 TTFT (ms):", "199.00"),
        ("Cache hit rate:", "13.3%"),
    ):
        assert f"{label:<40} {value}" in text  # SGLang's 40-column labels


def test_long_prompt_metrics_by_hand():
    # two decoders stepping every 10 ms, one 100 ms stall while the long prompt (sent at 0.05,
    # first token at 0.16) is prefilled
    times = [0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.15, 0.16, 0.17]
    outs = [
        _req(0.0, times, 0.17, len(times), 8, role=ROLE_DECODER),
        _req(0.0, times, 0.17, len(times), 8, role=ROLE_DECODER),
        _req(0.05, [0.16], 0.16, 1, 500, role=ROLE_LONG),
    ]
    m = long_prompt_metrics(outs)
    assert m.decoder_itl_median_ms == pytest.approx(10.0)
    # gaps sorted: 14 of 10 ms, then 2 of 100 ms; p99 at position 0.99 * 15 = 14.85 lies
    # between the two stalls
    assert m.decoder_itl_p99_ms == pytest.approx(100.0)
    assert m.decoder_itl_max_ms == pytest.approx(100.0)
    assert m.itl_p99_over_median == pytest.approx(10.0)
    assert m.long_ttft_ms == pytest.approx(110.0)
    # gaps overlapping (0.05, 0.16): the stall and the gap ending at 0.16, per decoder
    assert m.prefill_gaps == 4 and m.prefill_gap_max_ms == pytest.approx(100.0)
    assert m.prefill_gap_median_ms == pytest.approx(55.0)  # 100, 10 per decoder
    assert m.before_itl_median_ms == pytest.approx(10.0)  # the 5 gaps ending by 0.05
    assert set(m.as_row()) >= {"lpa_decoder_itl_p99_ms", "lpa_itl_p99_over_median"}
    assert any("P99 / median ITL:" in x and "10.00" in x for x in format_long_prompt(m))
    with pytest.raises(ValueError, match="long request"):
        long_prompt_metrics(outs[:2])


def test_jsonl_is_strict_and_appends(tmp_path):
    path = tmp_path / "r.jsonl"
    append_jsonl(str(path), {"a": math.inf, "b": [1.0, math.nan], "c": {"d": 2.5}})
    append_jsonl(str(path), {"a": 1})
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0]) == {"a": None, "b": [1.0, None], "c": {"d": 2.5}}
    with pytest.raises(ValueError, match="--output-file"):
        check_writable("--output-file", str(tmp_path / "missing" / "r.jsonl"))
    with pytest.raises(ValueError, match="folder"):
        check_writable("--plot", str(tmp_path))


def test_svg_picture_without_matplotlib(tmp_path):
    written = plot_latency(
        str(tmp_path / "lat.png"), [5.0, 7.0, 9.5], [1.0, 1.1, 4.0, 1.2], "t", use_matplotlib=False
    )
    assert written.endswith("lat.svg")
    root = ET.parse(written).getroot()  # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f".//{ns}rect")) == 2 * (40 + 1)  # bars + frame, per panel
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "TTFT (ms)" in texts and "ITL (ms)" in texts
    empty = svg_histograms([("ITL (ms)", [])])
    assert "no data" in empty


def test_matplotlib_picture(tmp_path):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "lat.png")
    assert plot_latency(path, [5.0, 7.0], [1.0, 2.0], "t", use_matplotlib=True) == path
    assert (tmp_path / "lat.png").read_bytes()[:4] == b"\x89PNG"
