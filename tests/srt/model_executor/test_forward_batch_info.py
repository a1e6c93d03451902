"""ForwardMode / ForwardBatch helpers."""

import pytest
import torch

from srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    compute_extend_metadata,
)


def test_modes():
    assert ForwardMode.EXTEND.is_extend() and not ForwardMode.EXTEND.is_decode()
    assert ForwardMode.DECODE.is_decode() and ForwardMode.DECODE.is_cuda_graph()
    assert ForwardMode.IDLE.is_idle() and not ForwardMode.IDLE.is_extend()


def test_extend_metadata():
    md = compute_extend_metadata([0, 5, 2], [1, 7, 33], "cpu")
    assert md["positions"].tolist() == [0] + list(range(5, 12)) + list(range(2, 35))
    assert md["extend_start_loc"].tolist() == [0, 1, 8]
    assert md["seq_lens"].tolist() == [1, 12, 35] and md["seq_lens_sum"] == 48
    assert md["extend_seq_lens"].dtype == torch.int32 and md["positions"].dtype == torch.int64
    with pytest.raises(ValueError, match="entries"):
        compute_extend_metadata([0], [1, 2], "cpu")
    with pytest.raises(ValueError, match="positive"):
        compute_extend_metadata([0], [0], "cpu")


def test_decode_positions_default_and_num_tokens():
    fb = ForwardBatch(
        ForwardMode.DECODE,
        2,
        torch.tensor([4, 5]),
        torch.tensor([0, 1]),
        torch.tensor([7, 1]),
        torch.tensor([9, 10]),
        8,
    )
    assert fb.positions.tolist() == [6, 0] and fb.num_tokens == 2
    assert fb.enable_fused_rope_kv and fb.device == torch.device("cpu")
