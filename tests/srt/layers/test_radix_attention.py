"""RadixAttention: validation, sinks kept unregistered, backend dispatch and IDLE mode."""

import pytest
import torch
from torch import nn

from srt.layers.attention.base_attn_backend import AttentionBackend
from srt.layers.radix_attention import RadixAttention
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


class _Recorder(AttentionBackend):
    def __init__(self):
        self.calls = []

    def init_forward_metadata(self, forward_batch):
        pass

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("decode", save_kv_cache, kw.get("sinks")))
        return q

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append(("extend", save_kv_cache, kw.get("sinks")))
        return q


def _fb(mode, backend):
    return ForwardBatch(
        mode,
        1,
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(1),
        torch.ones(1),
        torch.zeros(1, dtype=torch.int64),
        1,
        attn_backend=backend,
    )


def test_dispatch_and_sinks():
    owner = nn.Module()
    owner.sinks = nn.Parameter(torch.zeros(4))
    owner.attn = RadixAttention(4, 8, 0.5, 2, 0, sinks=owner.sinks)
    names = [n for n, _ in owner.named_parameters()]
    assert names == ["sinks"]  # not duplicated under attn
    be = _Recorder()
    q = torch.randn(1, 32)
    owner.attn(q, q[:, :16], q[:, :16], _fb(ForwardMode.DECODE, be), save_kv_cache=False)
    owner.attn(q, q[:, :16], q[:, :16], _fb(ForwardMode.EXTEND, be))
    assert [c[:2] for c in be.calls] == [("decode", False), ("extend", True)]
    assert be.calls[0][2] is owner.sinks
    out = owner.attn(q, None, None, _fb(ForwardMode.IDLE, be))
    assert out.shape == (1, 32) and len(be.calls) == 2


def test_validation():
    with pytest.raises(ValueError, match="multiple"):
        RadixAttention(6, 8, 1.0, 4, 0)
    with pytest.raises(ValueError, match="head_dim"):
        RadixAttention(4, 0, 1.0, 2, 0)
    layer = RadixAttention(4, 8, 1.0, 2, 0, sliding_window_size=0, v_head_dim=4)
    assert layer.sliding_window_size == -1 and layer.v_head_dim == 4
    with pytest.raises(ValueError, match="attn_backend"):
        layer(torch.zeros(1, 32), None, None, _fb(ForwardMode.DECODE, None))
