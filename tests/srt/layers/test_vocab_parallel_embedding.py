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
