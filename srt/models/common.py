"""The decoder skeleton the model files share: gated MLP, attention, decoder layer, model, LM.

A model file subclasses these under SGLang's names and sets what differs through class
attributes (q/k norm, sinks, float32 norm weights, its MLP), so checkpoints load with the
parameter names SGLang's models use (`model.layers.N.self_attn.qkv_proj.weight`, ...).

The attention layer lets RoPE write K and V into the KV cache when the pool allows it
(`enable_fused_set_kv_buffer`) and then runs attention with `save_kv_cache=False`.
Tensor parallelism: every class takes this rank's `tp_rank` and `tp_size` (default TP 1) and
passes them to its parallel layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

import sgl_ext
from srt.configs.model_config import ModelConfig
from srt.layers.activation import SiluAndMul
from srt.layers.gemm_choice import linear_config
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import RotaryEmbedding, get_rope
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.models.utils import create_fused_set_kv_buffer_arg, enable_fused_set_kv_buffer
from srt.models.weight_utils import LLAMA_STACKED_PARAMS, StackedParams, load_stacked_weights
from srt.utils.submodule import Submodule

if TYPE_CHECKING:
    from sgl_ext import FusedSetKVBufferArg
    from sgl_ext.gemm import GemmConfig
    from srt.layers.moe.topk_pairs import TopKPairs
    from srt.model_executor.forward_batch_info import ForwardBatch


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up packed in one matmul (SGLang's LlamaMLP)."""

    # children read without nn.Module.__getattr__ (srt/utils/submodule.py)
    gate_up_proj: Submodule[MergedColumnParallelLinear] = Submodule()
    down_proj: Submodule[RowParallelLinear] = Submodule()
    act_fn: Submodule[SiluAndMul] = Submodule()

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=bias,
            prefix="gate_up_proj",
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (model dtype)."""
        gate_up, _ = self.gate_up_proj(x)  # [T, 2 * I / tp]
        out, _ = self.down_proj(self.act_fn(gate_up))  # [T, I / tp] -> [T, hidden]
        return out


class RopeAttention(nn.Module):
    """Packed qkv -> (per-head q/k RMSNorm) -> RoPE (+ fused KV write) -> attention -> o_proj.

    Subclasses set `has_qk_norm` (Qwen3) or `has_sinks` (gpt-oss: one float32 logit per head
    joins the softmax). Sliding windows come from `config.get_window_left(layer_id)`.
    """

    has_qk_norm: bool = False
    has_sinks: bool = False
    # With q/k norm: one sgl_ext kernel does the per-head norm, RoPE and (when fused) the K/V
    # write. False (on a layer or the class) keeps the RMSNorm layers followed by the RoPE op,
    # for comparison.
    fuse_qk_norm: bool = True
    # Without q/k norm, at decode sizes where qkv_proj runs the skinny GEMM's broadcast path:
    # the RoPE and the K/V write in that GEMM's epilogue (one launch a layer fewer, the same
    # bits). False (on a layer or the class) keeps the GEMM and the RoPE op apart.
    fold_rope_into_qkv: bool = True

    # children read without nn.Module.__getattr__ (srt/utils/submodule.py)
    qkv_proj: Submodule[QKVParallelLinear] = Submodule()
    o_proj: Submodule[RowParallelLinear] = Submodule()
    q_norm: Submodule[RMSNorm] = Submodule()  # with has_qk_norm
    k_norm: Submodule[RMSNorm] = Submodule()  # with has_qk_norm
    rotary_emb: Submodule[RotaryEmbedding] = Submodule()
    attn: Submodule[RadixAttention] = Submodule()

    def __init__(
        self, config: ModelConfig, layer_id: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            prefix=f"layers.{layer_id}.qkv_proj",
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        # Heads on this TP rank (KV heads replicated when tp exceeds them).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_split = (self.q_size, self.kv_size, self.kv_size)
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        if self.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, weight_in_fp32=False)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, weight_in_fp32=False)
        sinks = None
        if self.has_sinks:  # float32 like HF (the sink logit joins the softmax in float32)
            sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), False)
            sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]
            self.sinks = sinks
        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim=self.head_dim,
            max_position=config.max_position_embeddings,
            base=config.rope_theta,
            is_neox_style=config.rope_is_neox_style,
            rope_scaling=config.rope_scaling,
            partial_rotary_factor=config.partial_rotary_factor,
        )
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            layer_id,
            sliding_window_size=config.get_window_left(layer_id),
            sinks=sinks,
        )

    def _load_sinks(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        """sinks: full float [Hq] -> this rank's heads [Hq / tp]."""
        n, r = self.num_heads, self.qkv_proj.tp_rank
        if loaded.shape == (self.qkv_proj.total_num_heads,):
            loaded = loaded.narrow(0, r * n, n)
        if loaded.shape != param.shape:
            raise ValueError(f"sinks: checkpoint shape {tuple(loaded.shape)} != {param.shape}")
        param.data.copy_(loaded)

    def _norm_heads(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        T = x.shape[0]
        x = norm(x.reshape(-1, self.head_dim))  # [T * H, D] (a copy of the strided view)
        return x.view(T, -1)  # [T, H * D]

    def norm_and_rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        fused_arg: FusedSetKVBufferArg | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k (with `has_qk_norm`), then RoPE; RoPE also stores K and V
        when `fused_arg` is given.

        positions int64 [T]; q [T, Hq*D], k [T, Hkv*D] (model dtype, views of qkv) -> rotated
        q [T, Hq*D], k [T, Hkv*D].
        """
        rope = self.rotary_emb
        if self.has_qk_norm:
            q_norm, k_norm = self.q_norm, self.k_norm
            # parameters read directly too (no nn.Module.__getattr__)
            q_w, k_w = q_norm._parameters["weight"], k_norm._parameters["weight"]
            assert q_w is not None and k_w is not None
            if self.fuse_qk_norm and q_w.dtype == q.dtype:
                # q/k normalised and rotated in place (and K/V stored with fused_arg). Without
                # fused_arg the same kernel runs without the write and attention saves K/V, so
                # the fused and unfused paths see the same q/k bits.
                sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
                    positions.reshape(-1),  # [T]
                    q,
                    k,
                    self.head_dim,
                    rope._cache_for(q.device),
                    q_w,
                    k_w,
                    q_norm.variance_epsilon,
                    is_neox=rope.is_neox_style,
                    fused_set_kv_buffer_arg=fused_arg,
                )
                return q, k
            q = self._norm_heads(q, q_norm)
            k = self._norm_heads(k, k_norm)
        return rope(positions, q, k, fused_set_kv_buffer_arg=fused_arg)

    def _qkv_rope_config(self, hidden_states: torch.Tensor) -> GemmConfig | None:
        """The skinny GEMM configuration of qkv_proj when one kernel can also do the RoPE (and
        the KV write) in its epilogue (`sgl_ext.qkv_proj_with_rope_kv`), else None."""
        if not self.fold_rope_into_qkv or self.has_qk_norm or not hidden_states.is_cuda:
            return None
        proj, rope = self.qkv_proj, self.rotary_emb
        if proj.skip_bias_add or type(rope).forward is not RotaryEmbedding.forward:
            return None
        weight = proj._parameters["weight"]
        assert weight is not None
        cfg = linear_config(hidden_states, weight)
        d = self.head_dim
        if cfg is None or cfg.dot or cfg.split_k != 1 or rope.rotary_dim != d:
            return None
        return cfg if 2 <= cfg.block_n <= d and d % cfg.block_n == 0 else None

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """positions int64 [T], hidden_states [T, hidden] -> [T, hidden] (model dtype)."""
        attn = self.attn
        fused = enable_fused_set_kv_buffer(forward_batch)
        cfg = self._qkv_rope_config(hidden_states)
        if cfg is not None:  # one kernel: the qkv GEMM, RoPE and (fused) the K/V write
            proj, rope = self.qkv_proj, self.rotary_emb
            weight = proj._parameters["weight"]
            assert weight is not None
            qkv = hidden_states.new_empty(hidden_states.shape[0], sum(self.qkv_split))
            q, k, v = qkv.split_with_sizes(self.qkv_split, -1)  # views of qkv
            arg = create_fused_set_kv_buffer_arg(v, attn, forward_batch) if fused else None
            sgl_ext.qkv_proj_with_rope_kv(
                hidden_states,
                weight,
                proj._parameters["bias"],
                positions.reshape(-1),  # [T]
                rope._cache_for(qkv.device),
                self.head_dim,
                self.num_kv_heads,
                qkv,
                rope.is_neox_style,
                arg,
                cfg,
            )
            out = attn(q, k, v, forward_batch, save_kv_cache=not fused)  # [T, Hq * D]
            out, _ = self.o_proj(out)  # [T, hidden]
            return out
        qkv, _ = self.qkv_proj(hidden_states)  # [T, (Hq + 2 Hkv) * D]
        # q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D]: strided views of qkv
        q, k, v = qkv.split_with_sizes(self.qkv_split, -1)
        arg = create_fused_set_kv_buffer_arg(v, attn, forward_batch) if fused else None
        q, k = self.norm_and_rope(positions, q, k, arg)
        out = attn(q, k, v, forward_batch, save_kv_cache=not fused)  # [T, Hq * D]
        out, _ = self.o_proj(out)  # [T, hidden]
        return out


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next RMSNorm.

    Subclasses set `attention_cls`, `mlp_cls`, `norm_weight_in_fp32` (gpt-oss), or override
    `build_mlp` (an MLP built otherwise, e.g. a MoE).
    """

    attention_cls: type[RopeAttention] = RopeAttention
    mlp_cls: type[GatedMLP] = GatedMLP
    norm_weight_in_fp32: bool = False

    # children read without nn.Module.__getattr__ (srt/utils/submodule.py)
    self_attn: Submodule[RopeAttention] = Submodule()
    mlp: Submodule[nn.Module] = Submodule()
    input_layernorm: Submodule[RMSNorm] = Submodule()
    post_attention_layernorm: Submodule[RMSNorm] = Submodule()

    def __init__(
        self, config: ModelConfig, layer_id: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id, tp_rank, tp_size)
        self.mlp = self.build_mlp(config, tp_rank, tp_size)
        h, eps, fp32 = config.hidden_size, config.rms_norm_eps, self.norm_weight_in_fp32
        self.input_layernorm = RMSNorm(h, eps, weight_in_fp32=fp32)
        self.post_attention_layernorm = RMSNorm(h, eps, weight_in_fp32=fp32)

    def build_mlp(self, config: ModelConfig, tp_rank: int, tp_size: int) -> nn.Module:
        return self.mlp_cls(
            config.hidden_size, config.intermediate_size, config.mlp_bias, tp_rank, tp_size
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | TopKPairs,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor | TopKPairs, torch.Tensor]:
        """hidden_states, residual: [T, hidden] -> (mlp output, residual), both [T, hidden]. A
        MoE MLP may hand over its pair rows uncombined (TopKPairs): the next norm adds them up."""
        # The norms with a residual run in place: this layer owns both tensors (the attention /
        # MLP output and the residual stream), so no new tensors per call.
        if residual is None:  # the first layer: hidden_states are the embeddings
            assert isinstance(hidden_states, torch.Tensor)
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual, inplace=True)
        attn_out: torch.Tensor = self.self_attn(positions, hidden_states, forward_batch)
        return self.norm_and_mlp(attn_out, residual)

    def norm_and_mlp(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor | TopKPairs, torch.Tensor]:
        """The post-attention norm (residual add in place), then the MLP: (its output,
        residual). A layer whose MLP can take the norm into its first kernel overrides this."""
        hidden_states, residual = self.post_attention_layernorm(
            hidden_states, residual, inplace=True
        )
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm: token ids -> hidden states [T, hidden]."""

    layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        self.layers = nn.ModuleList(
            [self.layer_cls(config, i, tp_rank, tp_size) for i in range(config.num_hidden_layers)]
        )
        fp32 = self.layer_cls.norm_weight_in_fp32
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, weight_in_fp32=fp32)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> hidden states [T, hidden] (model dtype)."""
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual, inplace=True)
        return hidden_states


class CausalLM(nn.Module):
    """A decoder model with its (possibly tied) LM head and logits processor.

    `forward(input_ids, positions, forward_batch)` -> LogitsProcessorOutput. `load_weights` packs
    the checkpoint's q/k/v and gate/up (`stacked_params_mapping`); subclasses may extend it.
    """

    model_cls: type[DecoderModel] = DecoderModel
    stacked_params_mapping: StackedParams = LLAMA_STACKED_PARAMS

    def __init__(
        self,
        config: ModelConfig,
        quant_config: object = None,
        prefix: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, tp_rank, tp_size)
        self.lm_head: nn.Module
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
            )
        self.logits_processor = LogitsProcessor(config)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        """input_ids, positions: int64 [T] -> LogitsProcessorOutput (float32 [B, V])."""
        hidden_states = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (q/k/v and gate/up into the packed parameters).

        Returns the names of the parameters that were loaded.
        """
        tied = self.config.tie_word_embeddings
        # tied: the embedding provides lm_head, whose checkpoint copy is skipped
        kept = (nw for nw in weights if not (tied and nw[0].startswith("lm_head.")))
        loaded = load_stacked_weights(self, kept, self.stacked_params_mapping)
        if tied:
            loaded.add("lm_head.weight")
        return loaded
