"""Greedy tokens on the GPU (srt/sampling/greedy.py): the same ids as torch.argmax, every case.

On CPU the kernel runs in the Triton interpreter; the GPU tests also check the pinned host copy,
a CUDA-graph replay and the runner's `greedy_ids`.
"""

import pytest
import torch

from srt.sampling.greedy import GreedySampler, argmax_native
from tests.conftest import HAS_CUDA, gpu

DEV = torch.device("cuda" if HAS_CUDA else "cpu")


def _logits(B: int, V: int, dtype: torch.dtype, seed: int, case: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g, dtype=torch.float32)
    if case == "ties" and V > 1:  # the max twice (and thrice in later rows): lowest index wins
        top = x.max() + 1.0
        x[:, V - 1] = top
        x[:, V // 3] = top
        x[1::2, V // 2] = top
    elif case == "nan":  # NaN above every number; the first NaN wins
        x[:, V - 1] = float("inf")
        x[:, (V * 2) // 3] = float("nan")
        x[1::2, V // 4] = float("nan")
    elif case == "zeros":  # all -0.0 with one 0.0 late: equal values, the first index
        x[:] = -0.0
        x[:, V - 1] = 0.0
    elif case == "negative":
        x = -x.abs() - 1.0
    elif case == "coarse":  # few distinct values: ties across blocks
        x = torch.randint(-3, 4, (B, V), generator=g).float()
    return x.to(dtype)


CASES = ["random", "ties", "nan", "zeros", "negative", "coarse"]


def _check(sampler: GreedySampler, logits: torch.Tensor) -> None:
    sampler.ids.fill_(-5)  # poison: unwritten ids show
    sampler.host.fill_(-5)
    ids = sampler.launch(logits)
    ref = argmax_native(logits)
    assert ids.tolist() == ref.tolist()
    if logits.is_cuda:
        torch.cuda.synchronize()
        assert sampler.tokens(logits.shape[0]) == ref.tolist()
    assert (sampler.acc == -(2**63)).all() and (sampler.count == 0).all()  # left reset


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("B,V", [(1, 1), (1, 7), (7, 33), (3, 2049), (2, 4097)])
def test_matches_torch_argmax(B, V, case):
    s = GreedySampler(8, DEV)
    _check(s, _logits(B, V, torch.float32, B * 1000 + V, case).to(DEV))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_and_strided_rows(dtype):
    s = GreedySampler(8, DEV)
    full = _logits(5, 3000, dtype, 3, "coarse").to(DEV)
    _check(s, full[:, :2500])  # rows at stride 3000
    _check(s, full[1:4])


def test_launches_back_to_back_reuse_the_buffers():
    s = GreedySampler(4, DEV)
    for seed in range(3):
        _check(s, _logits(4, 5000, torch.float32, seed, "random").to(DEV))


def test_bad_input_raises_before_launch():
    s = GreedySampler(2, DEV)
    with pytest.raises(ValueError, match="logits must be"):
        s.launch(torch.randn(3, 10, device=DEV))  # more rows than max_rows
    with pytest.raises(ValueError, match="logits must be"):
        s.launch(torch.randn(10, device=DEV))
    with pytest.raises(ValueError, match="float32, bf16 or fp16"):
        s.launch(torch.ones(1, 10, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="contiguous columns"):
        s.launch(torch.randn(10, 2, device=DEV).t())
    with pytest.raises(ValueError, match="max_rows"):
        GreedySampler(0, DEV)
    assert (s.acc == -(2**63)).all() and (s.count == 0).all()


def test_cpu_without_interpreter_uses_the_reference(monkeypatch):
    import srt.sampling.greedy as greedy

    monkeypatch.setattr(greedy, "interpreting", lambda: False)
    s = GreedySampler(4, torch.device("cpu"))
    x = _logits(3, 100, torch.float32, 9, "ties")
    assert s.launch(x).tolist() == argmax_native(x).tolist()
    assert s.tokens(3) == argmax_native(x).tolist()


@gpu
def test_gpt_oss_vocab_in_a_graph():
    """gpt-oss's vocabulary (201088): a captured launch gives each replay's ids on the host."""
    s = GreedySampler(8, DEV)
    logits = torch.empty(8, 201088, device=DEV)
    logits.copy_(_logits(8, 201088, torch.float32, 1, "random"))
    s.launch(logits)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s.launch(logits)
    for seed, case in enumerate(CASES):
        logits.copy_(_logits(8, 201088, torch.float32, seed + 10, case))
        s.host.fill_(-5)
        graph.replay()
        torch.cuda.synchronize()
        assert s.tokens(8) == argmax_native(logits).tolist(), case


def test_argmax_kernel_compiles_for_sm90():
    """A real sm_90 compile of the argmax kernel with its PDL entry, greedy and Gumbel (the
    interpreter runs it without PDL and misses front-end errors)."""
    from tests.sgl_ext.sgl_ext_testutil import run_compile_script

    run_compile_script(
        """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from srt.sampling.greedy import _argmax_kernel as K
for logits, gumbel in (("*fp32", False), ("*bf16", True)):
    sig = dict(Logits=logits, Acc="*i64", Count="*i32", Ids="*i64", Host="*i64", V="i32",
               stride_b="i32", NUM_BLOCKS="i32", Rows="*i64", Temps="*fp32", Seeds="*i64",
               BLOCK="constexpr", HAS_HOST="constexpr", GUMBEL="constexpr", USE_PDL="constexpr")
    consts = dict(BLOCK=2048, HAS_HOST=True, GUMBEL=gumbel, USE_PDL=True)
    triton.compile(ASTSource(K, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 8})
print("compiled")
"""
    )
