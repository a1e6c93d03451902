"""Greedy next tokens on the GPU: each row's argmax of the logits in one launch, written to the
device and straight into pinned host memory, so the host reads the tokens without a copy.

`torch.argmax(logits, -1).tolist()` is three pieces of work after a decode graph: a one-block
reduction (~9 µs over gpt-oss's 201088 logits on the H100), a device-to-pageable copy and the
copy's host path (~30 µs on the device host). Here program (b, j) reduces block j of row b to
one int64 key, ``(order(value) << 32) + (2**32 - 1 - index)``, so the largest key is the largest
value at its lowest index, and folds it into the row's accumulator with an atomic max. The
program that draws the row's last ticket (acquire after the others' release) reads and resets
the accumulator, resets the ticket and stores the index to `ids` and to `host`. The order of the
programs changes nothing.

`order` is torch.argmax's order: -0.0 equals 0.0, NaN is above every number and ties (NaNs
included) go to the lowest index. It maps a float32 to an int32 that sorts as the value does.

The same kernel samples (`gumbel_max`): the argmax of logits / T plus Gumbel noise is a draw
from softmax(logits / T), so a temperature-only sampled row costs one reduction like a greedy
one, not a sort of the vocabulary and a multinomial.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_ext.launch import cached_launcher, interpreting, pdl_enter

BLOCK = 2048  # logits a program (8 a thread at 8 warps)
_EMPTY = -(2**63)  # the accumulator between launches: below every key
_EMPTY_KEY: tl.constexpr = tl.constexpr(_EMPTY)


# The argmax kernel's runtime parameters in call order: its pointers first, so CachedLauncher
# launches it directly (the kernel declares V, stride_b and NUM_BLOCKS before Rows).
_ARGMAX_CALL = tuple("Logits Acc Count Ids Host Rows Temps Seeds V stride_b NUM_BLOCKS".split())


@triton.jit
def _argmax_kernel(
    Logits,  # [B, V] float32 / bf16 / fp16, rows at stride_b, columns contiguous
    Acc,  # int64 [B], _EMPTY between launches
    Count,  # int32 [B], zero between launches
    Ids,  # int64 [B] device
    Host,  # int64 [B] pinned host memory (HAS_HOST)
    V,
    stride_b,
    NUM_BLOCKS,
    Rows,  # int64 [B] (GUMBEL): program b reduces logits row Rows[b]
    Temps,  # float32 [B] (GUMBEL): temperature, > 0
    Seeds,  # int64 [B] (GUMBEL): the Philox seed of the row's noise
    BLOCK: tl.constexpr,
    HAS_HOST: tl.constexpr,
    GUMBEL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)  # in the decode graph: launched while the LM head runs
    b = tl.program_id(0)
    j = tl.program_id(1)
    idx = j * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] column
    ok = idx < V
    row = tl.load(Rows + b) if GUMBEL else b.to(tl.int64)
    x = tl.load(Logits + row * stride_b + idx, mask=ok, other=0.0).to(tl.float32)
    if GUMBEL:  # argmax of x / T + Gumbel noise: a draw from softmax(x / T)
        u = tl.rand(tl.load(Seeds + b), idx)  # [BLOCK] uniform in [0, 1), column-keyed
        x = x / tl.load(Temps + b) - tl.log(-tl.log(u))  # u == 0: -inf, never picked
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> 0.0: equal values must draw the same order
    bits = x.to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # sorts as x does
    order = tl.where(x != x, 0x7FFFFFFF, order)  # NaN: above +inf
    low = 4294967295 - idx.to(tl.int64)  # [0, 2**32): a lower index, a larger key
    key = tl.where(ok, (order.to(tl.int64) << 32) + low, _EMPTY_KEY)
    tl.atomic_max(Acc + b, tl.max(key, axis=0), sem="relaxed", scope="gpu")
    ticket = tl.atomic_add(Count + b, 1, sem="acq_rel", scope="gpu")
    if ticket == NUM_BLOCKS - 1:  # every block of the row is in Acc
        best = tl.atomic_xchg(Acc + b, _EMPTY_KEY, sem="acquire", scope="gpu")
        tl.store(Count + b, 0)  # no other program of this launch touches it again
        index = 4294967295 - (best & 4294967295)
        tl.store(Ids + b, index)
        if HAS_HOST:
            tl.store(Host + b, index)


def argmax_native(logits: torch.Tensor) -> torch.Tensor:
    """The reference: int64 [B], torch.argmax over the last dim in float32."""
    return torch.argmax(logits.float(), dim=-1)


def gumbel_max(
    logits: torch.Tensor, rows: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """One draw from softmax(logits[rows[i]] / temps[i]) per i, in one launch: the argmax of
    the scaled logits plus Gumbel noise from Philox at seeds[i] (the same seed and logits, the
    same token, whatever else is in the launch).

    Parameters
    ----------
    logits : float32 / bf16 / fp16 [B, V], columns contiguous, on CUDA (or the CPU under
        TRITON_INTERPRET).
    rows : int64 [R] rows of logits; temps : float32 [R], > 0; seeds : int64 [R]; on its device.

    Returns
    -------
    int64 [R] token ids.
    """
    r, v = rows.shape[0], logits.shape[1]
    if logits.dim() != 2 or logits.stride(1) != 1 or not 1 <= v < 2**31:
        raise ValueError(
            f"logits must be [B, 1 <= V < 2**31] with contiguous columns, got {tuple(logits.shape)}"
        )
    for name, t, dt in (
        ("rows", rows, torch.int64),
        ("temps", temps, torch.float32),
        ("seeds", seeds, torch.int64),
    ):
        if t.shape != (r,) or t.dtype != dt or t.device != logits.device:
            raise ValueError(f"{name} must be {dt} [{r}] on {logits.device}")
    ids = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r == 0:
        return ids
    acc = torch.full((r,), _EMPTY, dtype=torch.int64, device=logits.device)
    count = torch.zeros(r, dtype=torch.int32, device=logits.device)
    blocks = -(-v // BLOCK)
    cached_launcher(_argmax_kernel, _ARGMAX_CALL)[(r, blocks)](
        logits,
        acc,
        count,
        ids,
        ids,
        rows,
        temps,
        seeds,
        v,
        logits.stride(0),
        blocks,
        BLOCK=BLOCK,
        HAS_HOST=False,
        GUMBEL=True,
        num_warps=8,
    )
    return ids


class GreedySampler:
    """Buffers for greedy tokens of up to `max_rows` rows, kept for the owner's life (captured
    graphs hold their pointers): the accumulators and tickets the kernel leaves reset, the
    device ids and, on CUDA, their pinned host twin.

    Parameters
    ----------
    max_rows : the most rows one call takes.
    device : where the logits live.
    """

    def __init__(self, max_rows: int, device: torch.device) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.acc = torch.full((max_rows,), _EMPTY, dtype=torch.int64, device=self.device)
        self.count = torch.zeros(max_rows, dtype=torch.int32, device=self.device)
        self.ids = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(max_rows, dtype=torch.int64, pin_memory=cuda)
        # the logits whose argmax the last launch (or the graph replay that ran it) computes
        self.pending: torch.Tensor | None = None

    def launch(self, logits: torch.Tensor) -> torch.Tensor:
        """Write each row's argmax of logits to `ids` (and `host` on CUDA): one launch, no sync,
        capturable. `host[:B]` holds the tokens once the launch has completed.

        Parameters
        ----------
        logits : float32 / bf16 / fp16 [B, V], B <= max_rows, V < 2**31, columns contiguous.

        Returns
        -------
        int64 [B]: the device ids (a view of `ids`), what `argmax_native(logits)` gives.
        """
        if logits.dim() != 2 or logits.shape[0] > self.max_rows or logits.shape[1] < 1:
            raise ValueError(
                f"logits must be [B <= {self.max_rows}, V >= 1], got {tuple(logits.shape)}"
            )
        if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"logits must be float32, bf16 or fp16, got {logits.dtype}")
        if logits.device != self.device or logits.stride(1) != 1:
            raise ValueError(f"logits must be on {self.device} with contiguous columns")
        B, V = logits.shape
        if V >= 2**31:
            raise ValueError(f"logits has {V} columns; at most 2**31 - 1")
        self.pending = logits
        if B == 0:
            return self.ids[:0]
        cuda = self.device.type == "cuda"
        if not cuda and not interpreting():  # no Triton on the CPU: the reference
            return self.ids[:B].copy_(argmax_native(logits))
        blocks = -(-V // BLOCK)  # (triton.cdiv is a JIT function: µs of host a call)
        cached_launcher(_argmax_kernel, _ARGMAX_CALL)[(B, blocks)](
            logits,
            self.acc,
            self.count,
            self.ids,
            self.host if cuda else self.ids,
            self.ids,  # Rows, Temps, Seeds: unused
            self.ids,
            self.ids,
            V,
            logits.stride(0),
            blocks,
            BLOCK=BLOCK,
            HAS_HOST=cuda,
            GUMBEL=False,
            num_warps=8,
        )
        return self.ids[:B]

    def tokens(self, n: int) -> list[int]:
        """The first n tokens of the last launch as host ints, once it has completed (the
        caller synchronises): read from the pinned twin on CUDA, copied otherwise."""
        if self.device.type == "cuda":
            return self.host[:n].tolist()
        return self.ids[:n].tolist()
