"""srt's layers take SGLang's constructor and forward arguments as real parameters (the order an
unmodified SGLang model file passes them in), and refuse at build time, naming it, what srt
cannot serve: another quantization method, pipeline stages, DP attention, LoRA vocab, EPLB."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from srt.distributed import get_pp_indices
from srt.distributed.utils import get_group_rank_size
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    resolve_linear_parallel_group,
)
from srt.layers.logits_processor import LogitsProcessor
from srt.layers.moe.fused_moe_triton.layer import FusedMoE
from srt.layers.moe.fused_moe_triton.topk_experts import TopKExperts
from srt.layers.moe.topk import TopK
from srt.layers.quantization import Mxfp4Config, QuantizationConfig, get_quantization_config
from srt.layers.radix_attention import AttentionType, RadixAttention
from srt.layers.rotary_embedding import get_rope
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.utils import make_layers


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class LinearQuant(QuantizationConfig):
    """A config that quantizes linear layers (srt has no kernel for it)."""

    @classmethod
    def get_name(cls) -> str:
        return "w4a16_test"

    @classmethod
    def from_config(cls, config):
        return cls()

    def quantizes(self, kind, prefix=""):
        return kind == "linear"


def _decode_batch(b: int) -> ForwardBatch:
    return ForwardBatch(
        ForwardMode.DECODE,
        b,
        torch.zeros(b, dtype=torch.int64),
        torch.arange(b),
        torch.arange(1, b + 1),
        torch.zeros(b, dtype=torch.int64),
        b * (b + 1) // 2,
    )


def test_row_parallel_forward_takes_sglang_arguments():
    # SGLang's positional order: bias, input_is_parallel, skip_bias_add, params_dtype,
    # reduce_results, quant_config, prefix
    row = RowParallelLinear(6, 5, True, True, False, None, False, None, "mlp.down_proj")
    assert row.prefix == "mlp.down_proj" and not row.reduce_results
    row.weight.copy_(_rand(5, 6, seed=1))
    row.bias.copy_(_rand(5, seed=2))
    x = _rand(3, 6, seed=3)
    want = x @ row.weight.T + row.bias
    out, bias = row(x, forward_batch=_decode_batch(3))
    assert bias is None
    torch.testing.assert_close(out, want)
    # forward(input_, skip_all_reduce, forward_batch, output_tensor): the third is the batch
    buf = torch.empty(3, 5)
    out2, _ = row(x, True, _decode_batch(3), buf)
    assert out2 is buf and torch.equal(buf, out)
    skip = RowParallelLinear(6, 5, skip_bias_add=True)
    skip.load_state_dict(row.state_dict())
    out3, b3 = skip(x)
    assert b3 is skip.bias
    torch.testing.assert_close(out3 + b3, want)


def test_column_layers_take_sglang_arguments():
    x = _rand(4, 6, seed=4)
    col = ColumnParallelLinear(6, 8, False, True, prefix="c", parallel_group="attn_tp")
    col.weight.copy_(_rand(8, 6, seed=5))
    out, _ = col(x)  # gather_output at TP 1: the whole output
    torch.testing.assert_close(out, x @ col.weight.T)
    merged = MergedColumnParallelLinear(6, [3, 5], False, quant_config=Mxfp4Config(), prefix="m")
    assert merged.output_sizes == [3, 5] and merged.weight.shape == (8, 6)
    qkv = QKVParallelLinear(6, 2, 4, 2, False, False, None, None, "qkv", v_head_size=3)
    assert qkv.weight.shape == ((4 + 2) * 2 + 2 * 3, 6)
    rep = ReplicatedLinear(6, 2, True, False, None, None, "router")
    assert rep.prefix == "router" and rep.bias.shape == (2,)
    # "replicated" keeps the whole weight whatever TP position is passed
    r = ColumnParallelLinear(6, 8, tp_rank=1, tp_size=2, parallel_group="replicated")
    assert r.weight.shape == (8, 6) and get_group_rank_size(r.tp_group) == (0, 1)
    half = ColumnParallelLinear(6, 8, tp_rank=1, tp_size=2)
    assert get_group_rank_size(half.tp_group) == (1, 2)
    assert resolve_linear_parallel_group("tp") == (0, 1)  # no TP group in this process
    with pytest.raises(ValueError, match="parallel_group"):
        ColumnParallelLinear(6, 8, parallel_group="dp")


def test_row_input_not_parallel_keeps_this_ranks_columns():
    row = RowParallelLinear(6, 4, False, input_is_parallel=False, tp_rank=1, tp_size=2)
    row.weight_loader(row.weight, full := _rand(4, 6, seed=6))
    x = _rand(2, 6, seed=7)
    out, _ = row(x, skip_all_reduce=True)  # rank 1's partial sum over columns 3..5
    torch.testing.assert_close(out, x[:, 3:] @ full[:, 3:].T)


@pytest.mark.parametrize(
    ("build", "what"),
    [
        (lambda: RowParallelLinear(6, 4, quant_config=LinearQuant()), "w4a16_test"),
        (lambda: QKVParallelLinear(6, 2, 2, quant_config=LinearQuant(), prefix="q"), "w4a16_test"),
        (lambda: RowParallelLinear(6, 4, use_dp_attention_reduce=True), "DP attention"),
        (lambda: ColumnParallelLinear(6, 4, use_presharded_weights=True), "presharded"),
        (lambda: VocabParallelEmbedding(10, 4, org_num_embeddings=8), "LoRA"),
        (lambda: RadixAttention(2, 4, 0.5, 1, 0, is_cross_attention=True), "is_cross_attention"),
        (lambda: RadixAttention(2, 4, 0.5, 1, 0, attn_type=AttentionType.ENCODER_ONLY), "attn"),
        (lambda: RMSNorm(8, 1e-6, 4), "var_hidden_size"),
        (lambda: get_rope(8, 8, 64, 1e4, dual_chunk_attention_config={"a": 1}), "dual chunk"),
        (lambda: get_pp_indices(10, 0, 2), "pipeline"),
        (lambda: make_layers(4, lambda idx, prefix: torch.nn.Identity(), 1, 2), "pipeline"),
        (lambda: TopK(2, layer_id=0, use_grouped_topk=True), "use_grouped_topk"),
        (lambda: FusedMoE(4, 32, 32, 0, 2, num_fused_shared_experts=1), "shared"),
        (lambda: FusedMoE(4, 48, 32, 0, 2, quant_config=Mxfp4Config()), "multiples of 32"),
    ],
)
def test_unsupported_options_raise_at_build(build, what):
    with pytest.raises((NotImplementedError, ValueError), match=what):
        build()


def test_quantization_config_of_a_checkpoint():
    assert get_quantization_config(None) is None
    mx = get_quantization_config({"quant_method": "mxfp4", "modules_to_not_convert": ["x"]})
    assert isinstance(mx, Mxfp4Config) and mx.get_name() == "mxfp4"
    assert mx.quantizes("moe") and not mx.quantizes("linear") and mx.ignored_layers == ["x"]
    with pytest.raises(ValueError, match="'fp8'"):
        get_quantization_config({"quant_method": "fp8"})


def test_radix_attention_takes_sglang_positional_order():
    # (num_heads, head_dim, scaling, num_kv_heads, layer_id, logit_cap, v_head_dim,
    #  sliding_window_size, is_cross_attention, pos_encoding_mode, logit_capping_method,
    #  quant_config, attn_type, use_irope, prefix)
    a = RadixAttention(4, 8, 0.5, 2, 3, 30.0, 6, 7, False, "NONE", "tanh", None)
    assert (a.logit_cap, a.v_head_dim, a.sliding_window_size, a.layer_id) == (30.0, 6, 7, 3)
    b = RadixAttention(4, 8, 0.5, 2, 0, prefix="attn", quant_config=Mxfp4Config())
    assert b.prefix == "attn" and b.sliding_window_size == -1 and b.sinks is None


def test_logits_processor_from_a_model_config():
    cfg = SimpleNamespace(vocab_size=11, final_logit_softcapping=None)
    head = ParallelLMHead(11, 8, padding_size=8)  # SGLang pads the table: 16 rows, 5 dropped
    assert head.weight.shape == (16, 8)
    head.weight.copy_(_rand(16, 8, seed=8))
    h, fb = _rand(3, 8, seed=9), _decode_batch(3)
    aux = [_rand(3, 2, seed=10), _rand(3, 3, seed=11)]
    out = LogitsProcessor(cfg)(fb.input_ids, h, head, fb, aux)
    want = (h @ head.weight[:11].T).float()
    torch.testing.assert_close(out.next_token_logits, want)
    assert torch.equal(out.hidden_states, torch.cat(aux, -1))
    scaled = LogitsProcessor(cfg, False, 0.5)(fb.input_ids, h, head, fb)
    torch.testing.assert_close(scaled.next_token_logits, want * 0.5)
    capped = LogitsProcessor(SimpleNamespace(vocab_size=11, final_logit_softcapping=0.25))
    assert capped(fb.input_ids, h, head, fb).next_token_logits.abs().max() <= 0.25


def test_rmsnorm_cast_x_before_out_mul_and_fuse_input_quant():
    x = _rand(5, 33, seed=12).bfloat16()
    w = _rand(33, seed=13) * 0.3 + 1
    sg = RMSNorm(33, 1e-6).bfloat16()  # SGLang's default: multiply by the weight in float32
    hf = RMSNorm(33, 1e-6, cast_x_before_out_mul=True).bfloat16()  # HF Llama's order
    for n in (sg, hf):
        n.weight.copy_(w)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    wb = w.bfloat16()
    assert torch.equal(sg(x), (normed * wb.float()).bfloat16())
    assert torch.equal(hf(x), wb * normed.bfloat16())
    assert not torch.equal(sg(x), hf(x))
    proj = RowParallelLinear(33, 4)
    sg.fuse_input_quant(proj)
    assert sg._quant_linear is proj and [n for n, _ in sg.named_modules()] == [""]
    forced = RMSNorm(33, 1e-6, force_native=True, weight_in_fp32=True).bfloat16()
    forced.weight.copy_(w)
    assert torch.equal(forced(x), sg(x))


def test_topk_routing_and_fused_moe_match_topk_experts():
    """FusedMoE as SGLang's gpt-oss file builds and loads it (HF layout: interleaved gate/up,
    transposed by the model file) gives the bits of TopKExperts loaded from the same tensors."""
    E, H, inter, T = 4, 32, 16, 5
    g = torch.Generator().manual_seed(14)
    w13 = torch.randn(E, H, 2 * inter, generator=g) * 0.2  # HF gpt-oss [E, H, 2I]
    b13 = torch.randn(E, 2 * inter, generator=g) * 0.1
    w2 = torch.randn(E, inter, H, generator=g) * 0.2
    b2 = torch.randn(E, H, generator=g) * 0.1
    ours = TopKExperts(E, H, inter, activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=0.5)
    for p, t, sid in (
        (ours.w13_weight, w13, "gate_up_t_interleaved"),
        (ours.w13_bias, b13, "gate_up_bias_interleaved"),
        (ours.w2_weight, w2, "down_t"),
        (ours.w2_bias, b2, "down"),
    ):
        ours.weight_loader(p, t, sid)
    moe = FusedMoE(
        E, H, inter, 0, 2, activation="silu", gemm1_alpha=1.702, gemm1_clamp_limit=0.5,
        with_bias=True, use_weight_loader_fused=True, prefix="mlp.experts",
    )  # fmt: skip
    names = {n for n, _ in moe.named_parameters()}
    assert names == {"w13_weight", "w13_weight_bias", "w2_weight", "w2_weight_bias"}
    params = dict(moe.named_parameters())
    for name, t in (("w13_weight", w13), ("w13_weight_bias", b13), ("w2_weight", w2)):
        t = t if "bias" in name else t.transpose(-2, -1)  # what the model file does
        shard = "w13" if "w13" in name else "w2"
        params[name].weight_loader(params[name], t, f"experts.{name}", shard_id=shard)
    params["w2_weight_bias"].weight_loader(params["w2_weight_bias"], b2, "x", "w2")
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    top = TopK(2, layer_id=0, renormalize=True)(x, logits)
    assert top.topk_weights.dtype == x.dtype and torch.equal(top.router_logits, logits)
    assert torch.equal(moe(x, top), ours(x, top.topk_weights, top.topk_ids))
    plain = TopK(2, layer_id=0, renormalize=False)(x, logits)  # softmax over all, not rescaled
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(plain.topk_weights, probs.gather(1, plain.topk_ids))
    with pytest.raises(NotImplementedError, match="EPLB"):
        TopK(2, layer_id=0)(x, logits, expert_location_dispatch_info=object())
    assert FusedMoE.make_expert_params_mapping_fused("gu", "d", "gub", "db")[1] == (
        "experts.w13_weight_bias",
        "experts.gub",
        "w13",
    )


def test_environment_switches_srt_lacks_raise_when_set(monkeypatch):
    from srt.environ import envs

    assert envs.SGLANG_ENABLE_WEIGHT_LOADER_V2.get() is False
    monkeypatch.setenv("SGLANG_USE_AITER", "1")
    with pytest.raises(NotImplementedError, match="SGLANG_USE_AITER"):
        envs.SGLANG_USE_AITER.get()
    with pytest.raises(AttributeError, match="SGLANG_NOT_A_SWITCH"):
        envs.SGLANG_NOT_A_SWITCH  # noqa: B018


def test_make_layers_names_and_builds_every_layer():
    seen = []

    def build(idx, prefix):
        seen.append((idx, prefix))
        return torch.nn.Linear(1, 1)

    layers, start, end = make_layers(3, build, 0, 1, prefix="model.layers")
    assert (start, end, len(layers)) == (0, 3, 3)
    assert seen == [(0, "model.layers.0"), (1, "model.layers.1"), (2, "model.layers.2")]
