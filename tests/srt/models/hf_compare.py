"""Helpers for the model tests: tiny HF checkpoints, a driver for our models, HF references."""

from __future__ import annotations

import torch

from srt.configs.model_config import ModelConfig
from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from srt.model_loader.loader import get_model
from tests.srt.models.fb_harness import Harness, make_kv_pool


def save_hf_checkpoint(path, hf_model_cls, hf_config, seed=0, **save_kw):
    """Random-init an HF model (float32, eager attention) and save_pretrained it to `path`."""
    torch.manual_seed(seed)
    hf_config._attn_implementation = "eager"
    model = hf_model_cls(hf_config).float().eval()
    model.save_pretrained(str(path), **save_kw)
    return model


@torch.no_grad()
def hf_full_logits(hf_model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """float64 logits at every position of each sequence ([L, V]), one request at a time."""
    out = []
    for s in seqs:
        ids = torch.tensor([s])
        out.append(hf_model(input_ids=ids, use_cache=False).logits[0].double())
    return out


def make_prompts(vocab: int, lens=(1, 7, 33), steps=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    decode = torch.randint(3, vocab, (steps, len(lens)), generator=g).tolist()
    return prompts, decode


@torch.no_grad()
def run_model(
    model,
    config: ModelConfig,
    prompts,
    decode_tokens,
    *,
    page_size=1,
    fused=True,
    kv_dtype=None,
    backend_cls=TorchNativeAttnBackend,
    device="cpu",
    k_scale=None,
    v_scale=None,
):
    """Prefill all prompts in one EXTEND batch, then one DECODE batch per row of decode_tokens.

    Returns (prefill_all_logits [T, V] float32, [decode step logits [B, V] float32, ...], pool).
    """
    kv_dtype = kv_dtype or config.dtype
    pool = make_kv_pool(
        512,
        page_size,
        kv_dtype,
        config.num_key_value_heads,
        config.head_dim,
        config.num_hidden_layers,
        device,
    )
    for m in model.modules():
        if hasattr(m, "k_scale") and hasattr(m, "layer_id"):
            m.k_scale, m.v_scale = k_scale, v_scale
    backend = backend_cls(None, device)
    h = Harness(pool, backend, max_reqs=4, max_ctx=64, device=device, enable_fused_rope_kv=fused)
    rows = [3, 0, 2][: len(prompts)]
    fb = h.extend(rows, prompts)
    fb.return_all_logits = True
    out = model(fb.input_ids, fb.positions, fb)
    prefill = out.all_logits
    steps = []
    for toks in decode_tokens:
        fb = h.decode(rows, toks)
        steps.append(model(fb.input_ids, fb.positions, fb).next_token_logits)
    return prefill, steps, pool


def _close(got, ref, atol, rtol, norm_tol):
    got = got.detach().double().cpu()
    if norm_tol is None:
        torch.testing.assert_close(got.double(), ref, atol=atol, rtol=rtol)
        return
    # Quantised KV: per-row relative L2 error.
    err = (got.double() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert err.max() < norm_tol, f"relative L2 error {err.max():.4f} >= {norm_tol}"


def compare_with_hf(
    hf_model, prompts, decode_tokens, prefill, steps, atol=1e-4, rtol=1e-4, norm_tol=None, ref=None
):
    """Check our logits against HF's at every prefill position and every decode step."""
    if ref is None:
        seqs = [p + [d[i] for d in decode_tokens] for i, p in enumerate(prompts)]
        ref = hf_full_logits(hf_model, seqs)
    start = 0
    for i, p in enumerate(prompts):
        n = len(p)
        _close(prefill[start : start + n], ref[i][:n], atol, rtol, norm_tol)
        start += n
    for s, logits in enumerate(steps):
        for i, p in enumerate(prompts):
            # decode step s consumes token decode_tokens[s][i] at position len(p) + s
            _close(logits[i : i + 1], ref[i][len(p) + s][None], atol, rtol, norm_tol)


def load_ours(path, dtype="float32", device="cpu"):
    config = ModelConfig.from_hf(path, dtype=dtype)
    return get_model(config, device=device), config


def row_errors(a_prefill, a_steps, b_prefill, b_steps) -> torch.Tensor:
    """Relative L2 error of every logits row of run a against run b (float64 [rows])."""
    a = torch.cat([a_prefill, *a_steps]).double().cpu()
    b = torch.cat([b_prefill, *b_steps]).double().cpu()
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def gpu_bf16_check(path, max_err=0.05, median_err=0.02):
    """CUDA bf16 with the Triton backend vs CPU fp32 (native backend); fused == unfused exactly."""
    from srt.layers.attention.triton_backend import TritonAttnBackend

    cpu_model, cpu_cfg = load_ours(path)
    prompts, dec = make_prompts(cpu_cfg.vocab_size)
    ref = run_model(cpu_model, cpu_cfg, prompts, dec, page_size=16)
    model, cfg = load_ours(path, dtype="bfloat16", device="cuda")
    for page_size in (1, 16):
        runs = {
            fused: run_model(
                model,
                cfg,
                prompts,
                dec,
                page_size=page_size,
                fused=fused,
                backend_cls=TritonAttnBackend,
                device="cuda",
            )
            for fused in (True, False)
        }
        f, u = runs[True], runs[False]
        assert torch.equal(f[0], u[0])
        assert all(torch.equal(x, y) for x, y in zip(f[1], u[1], strict=True))
        for lid in range(cfg.num_hidden_layers):
            assert torch.equal(f[2].get_key_buffer(lid), u[2].get_key_buffer(lid))
            assert torch.equal(f[2].get_value_buffer(lid), u[2].get_value_buffer(lid))
        err = row_errors(f[0], f[1], ref[0], ref[1])
        assert err.median() < median_err and err.max() < max_err, (
            page_size,
            err.median(),
            err.max(),
        )
