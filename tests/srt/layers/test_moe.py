"""Top-k routed experts: routing, gpt-oss clamped SwiGLU, checkpoint layouts."""

import pytest
import torch

from srt.layers.moe import TopKExperts, select_experts


def _ref(x, w13, b13, w2, b2, weights, ids, alpha, limit, act):
    out = torch.zeros(x.shape, dtype=torch.float64)
    I2 = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = w13[e].double() @ x[t].double() + b13[e].double()
            g, u = h[:I2], h[I2:]
            if act == "silu":
                a = torch.nn.functional.silu(g) * u
            else:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                a = (u + 1) * g * torch.sigmoid(alpha * g)
            out[t] += weights[t, j].double() * (w2[e].double() @ a + b2[e].double())
    return out


@pytest.mark.parametrize(
    "act, path",
    [
        ("swiglu_oai", "dense"),
        ("swiglu_oai", "grouped"),
        ("swiglu_oai", "gathered"),
        ("silu", "dense"),
    ],
)
def test_experts_match_reference(act, path):
    g = torch.Generator().manual_seed(0)
    E, H, I2, T, k = 5, 12, 7, 9, 2
    if path == "gathered":  # T * k < E
        E = 19
    m = TopKExperts(E, H, I2, activation=act, swiglu_alpha=1.5, swiglu_limit=0.8)
    m.dense_max_tokens = 0 if path == "grouped" else 64
    for p in m.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    w, ids = select_experts(logits, k)
    torch.testing.assert_close(w.sum(-1), torch.ones(T))
    assert torch.equal(ids, logits.topk(k, -1).indices)
    out = m(x, w, ids)
    ref = _ref(x, m.w13_weight, m.w13_bias, m.w2_weight, m.w2_bias, w, ids, 1.5, 0.8, act)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    w2, ids2 = select_experts(logits, k, softmax_after_topk=False)
    assert torch.equal(ids2, ids) and (w2.sum(-1) < 1).all()


def test_checkpoint_layouts():
    E, H, I2 = 3, 4, 2
    m = TopKExperts(E, H, I2)
    ours = torch.randn(E, 2 * I2, H)  # gate rows then up rows
    inter = torch.empty_like(ours)
    inter[:, 0::2], inter[:, 1::2] = ours[:, :I2], ours[:, I2:]
    m.weight_loader(m.w13_weight, inter.transpose(1, 2), "gate_up_t_interleaved")
    assert torch.equal(m.w13_weight, ours)
    m.w13_weight.zero_()
    m.weight_loader(m.w13_weight, inter, "gate_up_interleaved")
    assert torch.equal(m.w13_weight, ours)
    down = torch.randn(E, H, I2)
    m.weight_loader(m.w2_weight, down.transpose(1, 2), "down_t")
    assert torch.equal(m.w2_weight, down)
    b = torch.randn(E, 2 * I2)
    m.weight_loader(m.w13_bias, b, "gate_up_bias_interleaved")
    assert torch.equal(m.w13_bias[:, :I2], b[:, 0::2])
    with pytest.raises(ValueError, match="shard_id"):
        m.weight_loader(m.w2_weight, down, "nope")
    with pytest.raises(ValueError, match="shape"):
        m.weight_loader(m.w2_weight, down.transpose(1, 2), "down")
    with pytest.raises(ValueError, match="activation"):
        TopKExperts(2, 4, 2, activation="gelu")
