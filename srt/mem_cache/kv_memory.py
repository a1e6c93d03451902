"""KV-cache memory arithmetic: bytes per token, pool sizes and the memory report.

Used by the model runner to size the pools (uniform `MHATokenToKVPool` or hybrid `SWAKVPool`)
and by `Engine` / `bench_one_batch` to report them. Pure functions of integers: no tensors.

A window layer reads the last W + 1 tokens of a request (W = window-left, gpt-oss: 127). Between
steps a running request holds the window slots of tokens kv_len - W .. kv_len - 1 and the step
adds one: W + 1 tokens, in at most `(W + page_size - 1) // page_size + 1` pages. A prefill holds
window slots for its whole prompt until the step ends (the extend attention reads every prompt
token), so the window pool also has room for one prompt of the full context length.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheShape:
    """What one token costs in each layer kind (one TP rank)."""

    num_full_layers: int  # layers whose pool holds every token (all layers of a uniform pool)
    num_swa_layers: int  # sliding-window layers with their own pool (0: uniform pool)
    head_num: int  # KV heads
    head_dim: int
    v_head_dim: int
    elem_bytes: int  # bytes per stored element (fp8: 1)

    @property
    def layer_bytes_per_token(self) -> int:
        return self.head_num * (self.head_dim + self.v_head_dim) * self.elem_bytes

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes of one token in the full pool (all its layers)."""
        return self.num_full_layers * self.layer_bytes_per_token

    @property
    def swa_bytes_per_token(self) -> int:
        """Bytes of one token in the window pool (all window layers)."""
        return self.num_swa_layers * self.layer_bytes_per_token

    @property
    def uniform_bytes_per_token(self) -> int:
        """Bytes of one token if every layer kept every token (today's uniform pool)."""
        return self.full_bytes_per_token + self.swa_bytes_per_token


def default_request_rows(max_total_tokens: int, context_len: int) -> int:
    """Request rows (max_running_requests) of a uniform GPU pool when none is given: SGLang's
    rule, 512 per context's worth of KV slots, within [2048, 4096]. The row table costs
    4 * context_len bytes a row; a hybrid pool keeps 256 rows, as its window pool grows with
    them."""
    return min(max(max_total_tokens // max(1, context_len) * 512, 2048), 4096)


def swa_tokens_per_request(sliding_window_size: int, page_size: int) -> int:
    """Window slots (whole pages) one running request may hold at once outside a prefill."""
    pages = (sliding_window_size + page_size - 1) // page_size + 1
    return pages * page_size


def swa_pool_size(
    sliding_window_size: int, page_size: int, max_running_requests: int, context_len: int
) -> int:
    """Usable window slots: every request row at its window, plus one full-context prompt."""
    prompt = (context_len + page_size - 1) // page_size * page_size + page_size
    return max_running_requests * swa_tokens_per_request(sliding_window_size, page_size) + prompt


@dataclass(frozen=True)
class KVMemoryReport:
    """The pools' sizes and what they cost.

    max_total_num_tokens is the number of tokens the pools can hold (all requests together:
    the full pool's size); uniform_max_total_num_tokens what a uniform pool would hold in the
    same bytes.
    """

    shape: KVCacheShape
    page_size: int
    max_total_num_tokens: int
    swa_max_total_num_tokens: int  # 0 for a uniform pool
    total_bytes: int  # both pools, padding pages included

    @property
    def uniform_max_total_num_tokens(self) -> int:
        per_token = self.shape.uniform_bytes_per_token
        return max(0, self.total_bytes // per_token - self.page_size)

    @property
    def token_ratio(self) -> float:
        """max_total_num_tokens over a uniform pool's in the same bytes."""
        return self.max_total_num_tokens / max(1, self.uniform_max_total_num_tokens)

    def describe(self) -> str:
        """One line for logs and benchmark output."""
        s, gib = self.shape, 2**30
        if s.num_swa_layers == 0:
            return (
                f"KV pool (uniform): {s.full_bytes_per_token} B/token over {s.num_full_layers}"
                f" layers, {self.max_total_num_tokens} tokens, {self.total_bytes / gib:.2f} GiB"
            )
        return (
            f"KV pool (hybrid SWA): full {s.full_bytes_per_token} B/token over"
            f" {s.num_full_layers} layers, window {s.swa_bytes_per_token} B/token over"
            f" {s.num_swa_layers} layers ({self.swa_max_total_num_tokens} window slots);"
            f" {self.max_total_num_tokens} tokens in {self.total_bytes / gib:.2f} GiB"
            f" (uniform: {self.uniform_max_total_num_tokens} tokens, x{self.token_ratio:.2f})"
        )


def kv_memory_report(
    shape: KVCacheShape, page_size: int, full_tokens: int, swa_tokens: int = 0
) -> KVMemoryReport:
    """The report of pools of `full_tokens` / `swa_tokens` usable slots (+ one padding page)."""
    total = (full_tokens + page_size) * shape.full_bytes_per_token
    if shape.num_swa_layers:
        total += (swa_tokens + page_size) * shape.swa_bytes_per_token
    return KVMemoryReport(shape, page_size, full_tokens, swa_tokens, total)


def hybrid_token_capacity(
    budget_bytes: int,
    shape: KVCacheShape,
    sliding_window_size: int,
    page_size: int,
    max_running_requests: int,
    context_len: int,
) -> KVMemoryReport:
    """Size a hybrid pool to `budget_bytes`: the window pool from the window and the request
    rows (`swa_pool_size`), the full pool from the rest (whole pages).

    Raises ValueError if the window pool alone does not fit the budget.
    """
    swa = swa_pool_size(sliding_window_size, page_size, max_running_requests, context_len)
    rest = budget_bytes - (swa + page_size) * shape.swa_bytes_per_token
    full = (rest // shape.full_bytes_per_token - page_size) // page_size * page_size
    if full < page_size:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes leaves no room for the full pool after the"
            f" window pool of {swa} slots"
        )
    return kv_memory_report(shape, page_size, full, swa)
