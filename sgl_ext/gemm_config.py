"""GemmConfig: one launch configuration of the skinny decode GEMM (`gemm.py`'s op, its Triton
kernels in `triton/gemm.py` and the qkv GEMM's epilogue variant `triton/gemm_rope_kv.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_ext import _common as C


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the skinny GEMM.

    block_n : output columns (weight rows) per program, power of two (>= 16 with dot).
    block_k : K elements per loop step, power of two >= 16.
    num_warps, num_stages : Triton launch options (warps a power of two <= 16; stages >= 1).
    split_k : K ranges summed by separate programs then added in order by a second kernel.
    dot : tensor-core dot (swap AB, BLOCK_M >= 16) instead of broadcast multiply + sum.
    """

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    dot: bool = False

    def __post_init__(self) -> None:
        def p2(v: object) -> bool:
            return isinstance(v, int) and v >= 1 and v & (v - 1) == 0

        if not p2(self.block_n) or not p2(self.block_k) or self.block_k < 16:
            raise ValueError(
                f"config: block_n / block_k must be powers of two (block_k >= 16): {self}"
            )
        if self.dot and self.block_n < 16:
            raise ValueError(f"config: dot needs block_n >= 16: {self}")
        if not p2(self.num_warps) or self.num_warps > 16:
            raise ValueError(f"config: num_warps must be a power of two <= 16: {self}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"config: num_stages must be >= 1: {self}")
        if not isinstance(self.split_k, int) or not 1 <= self.split_k <= 64:
            raise ValueError(f"config: split_k must be in [1, 64]: {self}")

    def block_m(self, m: int) -> int:
        """Rows of x per program: pow2(m), at least 16 for dots."""
        return max(16, C.next_pow2(m)) if self.dot else C.next_pow2(m)

    @property
    def tag(self) -> str:
        """Short name for tables: e.g. `fma n16 k256 w4 s3 x1`."""
        kind = "dot" if self.dot else "fma"
        return (
            f"{kind} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages} "
            f"x{self.split_k}"
        )
