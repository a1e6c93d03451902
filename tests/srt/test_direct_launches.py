"""On the GPU, srt's per-step Triton kernels launch through CachedLauncher's plans (directly,
after each plan's first JIT launch), never through its JIT fallback: a call off the pointers-
first convention would pay the JIT's host time at every eager call. Each case reruns an
existing value test (twice: the second call of a plan is the direct launch) with the fallback
turned into a failure. (GPU only: on the CPU every launch is interpreted.)"""

from __future__ import annotations

import pytest
import torch

from sgl_ext.triton import launcher as L
from tests.conftest import gpu


def _argmax():
    from tests.srt.sampling.test_greedy import test_launches_back_to_back_reuse_the_buffers
    from tests.srt.sampling.test_token_sampler import test_gumbel_max_draws_from_the_softmax

    test_launches_back_to_back_reuse_the_buffers()
    test_gumbel_max_draws_from_the_softmax(torch.float32)


def _topk():
    from tests.srt.layers.test_topk import test_kernel_matches_torch

    test_kernel_matches_torch(7, 32, 4, torch.float32, torch.bfloat16)


def _router():
    from tests.srt.layers.test_router_topk import (
        test_add_norm_variant_is_the_norm_then_the_router,
        test_matches_torch_routing_and_words,
    )

    test_matches_torch_routing_and_words(7, 32, 4, 96)
    test_add_norm_variant_is_the_norm_then_the_router(7, 2880)


def _decode_rows():
    from tests.srt.mem_cache.test_decode_writes import (
        test_kernel_extras_write_exactly_what_the_torch_ops_write,
    )

    test_kernel_extras_write_exactly_what_the_torch_ops_write(33)


@gpu
@pytest.mark.parametrize("case", [_argmax, _topk, _router, _decode_rows])
def test_per_step_kernels_launch_from_plans(case, monkeypatch):
    def fallback(self, grid, args, kwargs):
        pytest.fail(f"{self.fn} went through the JIT fallback (a tensor among its scalars?)")

    monkeypatch.setattr(L.CachedLauncher, "_jit", fallback)
    for _ in range(2):
        case()
