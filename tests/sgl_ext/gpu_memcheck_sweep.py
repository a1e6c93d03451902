"""A sweep of fused-op calls on CUDA for `compute-sanitizer --tool memcheck` (exit 1 on mismatch).

python -m tests.sgl_ext.gpu_memcheck_sweep   (from the repository root; also runs without the
sanitizer)
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

from tests.sgl_ext.test_reliability import _nonfinite_store
from tests.sgl_ext.test_rope import run_case


def main() -> int:
    os.environ["SGL_EXT_BACKEND"] = os.environ.get("SGL_EXT_BACKEND", "triton")
    n = 0
    # Each case twice: the second call of a launch plan is a direct launch of the compiled kernel.
    for layout, kv, neox, rot, t, _ in itertools.product(
        ["token", "flat", "nhd", "hnd", "cross"],
        [None, torch.float8_e4m3fn],
        [True, False],
        [1.0, 0.5],
        [1, 33],
        [0, 1],
    ):
        run_case(
            device="cuda",
            dtype=torch.bfloat16,
            kv_dtype=kv,
            layout=layout,
            neox=neox,
            rot_frac=rot,
            num_tokens=t,
            hq=8,
            hkv=2,
            d=64,
            scale="tensor" if kv else "none",
            num_slots=64,
            page_size=16,
            seed=n,
        )
        n += 1
    # Batches past the small-T layouts: merged programs, token-major (257), key/value first
    # (D = 128 in the default heuristic's windows: 449 bf16, 401 fp8) and fp8's 16-head blocks
    # (897; D = 64 with the register cap).
    for layout, kv in itertools.product(
        ["token", "flat", "nhd", "hnd", "cross"], [None, torch.float8_e4m3fn]
    ):
        big = ((897, 128, 16), (897, 64, 16)) if kv else ()
        for t, d, hq in ((257, 64, 8), (401 if kv else 449, 128, 16), *big):
            run_case(
                device="cuda",
                dtype=torch.bfloat16,
                kv_dtype=kv,
                layout=layout,
                rot_frac=1.0,
                num_tokens=t,
                hq=hq,
                hkv=2,
                d=d,
                scale="tensor" if kv else "none",
                num_slots=1024,
                page_size=16,
                seed=n,
            )
            n += 1
    for kv in (torch.float8_e4m3fn, torch.float8_e5m2):  # NaN / inf into fp8 caches
        for _ in range(2):
            row = _nonfinite_store(kv, "cuda")
            assert row.isnan().any(), row
            n += 1
    torch.cuda.synchronize()
    print(f"memcheck sweep: {n} cases OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
