"""benchmarks/bench_graph_ablation.py: its variant grammar, the module and kernel patches (each
dup runs twice, each skip not at all after the first call, nothing left patched) and one
eager run on the embedded tiny model."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from sgl_ext.triton.launcher import cached_launcher, make_launcher
from tests.srt.benchmark_scripts import load_benchmark


def _tool():
    return load_benchmark("bench_graph_ablation")


def test_variant_grammar():
    t = _tool()
    assert t.parse_variant("base") == ()
    acts = t.parse_variant("dup:module:input_layernorm+skip:kernel:moe_sum_kernel")
    assert acts == (
        t.Action("dup", "module", "input_layernorm"),
        t.Action("skip", "kernel", "moe_sum_kernel"),
    )
    for bad in ("dup", "twice:module:x", "dup:op:x", "skip:kernel:"):
        with pytest.raises(ValueError, match="expected <dup|skip>"):
            t.parse_variant(bad)


def test_cli_rejects_a_bad_variant_in_one_line(capsys):
    t = _tool()
    with pytest.raises(SystemExit) as e:
        t.parse_args(["--variants", "base", "dup:module"])
    assert e.value.code == 2
    assert "error: variant action 'dup:module'" in capsys.readouterr().err
    for bad in (["--replays", "5", "--device", "cpu"], ["--replays", "-1"]):
        with pytest.raises(SystemExit) as e:
            t.parse_args(bad)
        assert e.value.code == 2
        assert "error: --replays needs N >= 1 and CUDA graphs" in capsys.readouterr().err


def test_table_least_or_median():
    t = _tool()
    steps = {"base": [2.0, 2.2, 2.1], "dup:module:x": [2.5, 2.3, 2.4]}
    least = t.table(steps, 10).splitlines()
    assert least[2] == "| base | 2.000 / 2.200 / 2.100 | 2.000 | +0 µs | +0.00 µs |"
    assert least[3].endswith("| 2.300 | +300 µs | +30.00 µs |")
    med = t.table(steps, 10, median=True).splitlines()
    assert "median" in med[0] and med[2].split("|")[3].strip() == "2.1000"
    assert med[3].endswith("| 2.4000 | +300 µs | +30.00 µs |")


class _Count(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.calls


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _Count()
        self.b = torch.nn.ModuleDict({"norm": _Count()})


def test_module_dup_and_skip_then_restored():
    t = _tool()
    net = _Net()
    x = torch.randn(3)
    with t.patched(net, t.parse_variant("dup:module:a+skip:module:norm")):
        net.a(x)
        first = net.b["norm"](x)
        again = net.b["norm"](x)
        net.b["norm"](torch.randn(5))  # a new shape runs once more
    assert net.a.calls == 2 and net.b["norm"].calls == 2
    assert again is first
    net.a(x), net.b["norm"](x)
    assert net.a.calls == 3 and net.b["norm"].calls == 3  # unpatched again
    with pytest.raises(ValueError, match="no module"):
        with t.patched(net, t.parse_variant("dup:module:missing")):
            pass


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


@pytest.mark.parametrize("via", ["cached", "plan"])
@pytest.mark.parametrize("what, added", [("base", 1), ("dup", 2), ("skip", 0)])
def test_kernel_dup_and_skip(what, added, via):
    """Both launchers: CachedLauncher (per-call arguments) and a plan's KernelLauncher (its
    JIT launch, then direct launches where the device allows them)."""
    t = _tool()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(7, device=dev)
    want = x + added
    plan = make_launcher(_add_one_kernel, (1,), (7,), {"BLOCK": 8}, {}, dev)

    def launch() -> None:
        if via == "cached":
            cached_launcher(_add_one_kernel)[(1,)](x, 7, BLOCK=8)
        elif plan.compiled is not None:
            plan.direct(x.data_ptr())
        else:
            plan.launch(x)

    variant = "base" if what == "base" else f"{what}:kernel:_add_one_kernel"
    with t.patched(torch.nn.Module(), t.parse_variant(variant)):
        launch()
    torch.testing.assert_close(x, want)
    launch()  # unpatched: once
    torch.testing.assert_close(x, want + 1)


@pytest.mark.slow
def test_tiny_model_eager_run(capsys):
    t = _tool()
    before = os.environ.get("SGL_EXT_FAST_LAUNCH")
    out = t.main(
        ["--model-preset", "tiny", "--device", "cpu", "--input-len", "8", "--output-len", "3"]
        + ["--rounds", "1", "--variants", "base", "dup:module:input_layernorm"]
        + ["skip:kernel:rope_kv_kernel+dup:module:self_attn.qkv_proj"]
    )
    rows = [r for r in out.splitlines() if r.startswith("| base") or r.startswith("| dup")]
    assert len(rows) == 2 and "+0 µs" in rows[0]
    assert os.environ.get("SGL_EXT_FAST_LAUNCH") == before  # put back
