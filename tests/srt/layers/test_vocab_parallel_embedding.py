"""Embedding, LM head and LogitsProcessor (pruning to each request's last token)."""

import pytest
import torch

from srt.layers.logits_processor import LogitsProcessor
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    compute_extend_metadata,
)


def test_embedding_and_loader():
    w = torch.randn(11, 6)
    emb = VocabParallelEmbedding(11, 6)
    emb.weight.weight_loader(emb.weight, w)
    ids = torch.tensor([0, 10, 3, 3])
    assert torch.equal(emb(ids), w[ids])
    with pytest.raises(ValueError, match="shape"):
        emb.weight.weight_loader(emb.weight, w[:5])
    with pytest.raises(RuntimeError, match="LogitsProcessor"):
        ParallelLMHead(11, 6)(ids)


DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "vp, d, start, dtype",
    [(11, 6, 0, torch.float32), (257, 1031, 5, torch.bfloat16), (33, 2880, 40, torch.float16)],
)
def test_embedding_rows_kernel_copies_rows_and_masks_other_slices(vp, d, start, dtype):
    """The gather kernel (CUDA, or interpreted on the CPU): each id's row exactly, zeros for ids
    outside [start, start + vp) (another TP rank's), every element written (poisoned output
    allocation is the op's own: checked by NaN-free zero rows); int32 ids and 2-d ids too."""
    from srt.layers.vocab_parallel_embedding import embedding_rows

    g = torch.Generator().manual_seed(vp + d)
    w = torch.randn(vp, d, generator=g).to(DEV, dtype)
    ids = torch.randint(start - 3, start + vp + 3, (37,), generator=g).to(DEV)
    ids[:3] = torch.tensor([start, start + vp - 1, start + vp])  # both ends and one past
    local = ids - start
    ours = (local >= 0) & (local < vp)
    want = torch.where(ours[:, None], w[local.clamp(0, vp - 1)], torch.zeros((), dtype=dtype))
    want = want.to(DEV)
    for got in (embedding_rows(ids, w, start), embedding_rows(ids.int(), w, start)):
        assert got.dtype == dtype and got.shape == (37, d)
        assert torch.equal(got, want)
    assert torch.equal(embedding_rows(ids.view(37, 1), w, start), want.view(37, 1, d))
    assert embedding_rows(ids[:0], w, start).shape == (0, d)
    if DEV == "cuda":
        with pytest.raises(ValueError, match="ids"):
            embedding_rows(ids.cpu(), w, start)


def _extend_batch(prefix, lens):
    md = compute_extend_metadata(prefix, lens, "cpu")
    T = sum(lens)
    return ForwardBatch(
        ForwardMode.EXTEND,
        len(lens),
        torch.zeros(T, dtype=torch.int64),
        torch.arange(len(lens)),
        out_cache_loc=torch.zeros(T, dtype=torch.int64),
        **md,
    )


def test_logits_processor_prunes_extend_and_keeps_decode():
    g = torch.Generator().manual_seed(0)
    head = ParallelLMHead(13, 8)
    head.weight.copy_(torch.randn(13, 8, generator=g))
    lp = LogitsProcessor(vocab_size=11)  # drops 2 padded vocab rows
    fb = _extend_batch([0, 4, 2], [1, 7, 3])
    h = torch.randn(11, 8, generator=g)
    out = lp(fb.input_ids, h, head, fb)
    full = (h.double() @ head.weight.double().T)[:, :11]
    last = torch.tensor([0, 7, 10])
    torch.testing.assert_close(out.next_token_logits.double(), full[last], atol=1e-5, rtol=1e-5)
    assert out.next_token_logits.dtype == torch.float32 and out.all_logits is None
    fb.return_all_logits = True
    out = lp(fb.input_ids, h, head, fb)
    torch.testing.assert_close(out.all_logits.double(), full, atol=1e-5, rtol=1e-5)
    dec = ForwardBatch(
        ForwardMode.DECODE,
        3,
        torch.zeros(3, dtype=torch.int64),
        torch.arange(3),
        torch.tensor([5, 9, 1]),
        torch.zeros(3, dtype=torch.int64),
        15,
    )
    assert torch.equal(dec.positions, torch.tensor([4, 8, 0]))
    out = lp(dec.input_ids, h[:3], head, dec)
    torch.testing.assert_close(out.next_token_logits.double(), full[:3], atol=1e-5, rtol=1e-5)
    capped = LogitsProcessor(11, final_logit_softcapping=0.5)(dec.input_ids, h[:3], head, dec)
    assert capped.next_token_logits.abs().max() <= 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m, drop", [(1, 0), (3, 2), (8, 0)])
def test_cuda_decode_logits_take_the_table_gemm(monkeypatch, m, drop):
    """On CUDA the LM head's projection goes through gemm_choice: a table row for its (V, H, M
    bucket) sends it to the skinny Triton GEMM, within bf16 rounding of float64. Without padded
    rows (drop 0) the GEMM stores the float32 logits itself: the bf16 product's bits widened."""
    from sgl_ext.gemm import GemmConfig
    from srt.layers import gemm_choice as gc

    calls = []
    real = gc.linear_small_m
    monkeypatch.setattr(
        gc, "linear_small_m", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw)
    )
    torch.manual_seed(m)
    V, H = 1031, 264  # odd sizes: a partial N tile, K not a multiple of the block
    head = ParallelLMHead(V, H, params_dtype=torch.bfloat16).cuda()
    head.weight.data.normal_(std=H**-0.5)
    h = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    dec = ForwardBatch(
        ForwardMode.DECODE,
        m,
        torch.zeros(m, dtype=torch.int64),
        torch.arange(m),
        torch.full((m,), 5),
        torch.zeros(m, dtype=torch.int64),
        5 * m,
    )
    lp = LogitsProcessor(vocab_size=V - drop)
    cfg = GemmConfig(block_n=4, block_k=256, dot=False)
    with gc.use_gemm_choices({(V, H, gc.m_bucket(m)): cfg}):
        out = lp(dec.input_ids, h, head, dec).next_token_logits
        half = real(h, head.weight, None, cfg)  # [m, V] bf16
    assert calls == [(V, H)]
    want = (h.double() @ head.weight.double().T)[:, : V - drop]
    assert out.dtype == torch.float32 and out.shape == (m, V - drop)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=1.6e-2)
    assert torch.equal(out, half[:, : V - drop].float())


def test_gather_kernel_compiles_for_sm90():
    """A real sm_90 compile of the gather kernel with its PDL entry (the interpreter runs it
    without PDL and misses front-end errors)."""
    from tests.sgl_ext.sgl_ext_testutil import run_compile_script

    run_compile_script(
        """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from srt.layers.vocab_parallel_embedding import _gather_rows_kernel as K
for ids in ("*i64", "*i32"):
    sig = dict(Ids=ids, Weight="*bf16", Out="*bf16", start="i32", Vp="i32", D="i32",
               stride_w="i32", BLOCK="constexpr", USE_PDL="constexpr")
    triton.compile(ASTSource(K, sig, dict(BLOCK=1024, USE_PDL=True), {}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("compiled")
"""
    )
