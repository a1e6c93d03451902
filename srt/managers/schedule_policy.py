"""Admission of waiting requests (SGLang's `schedule_policy.py` concern): what fits, and the
cached prefix each admitted request starts from.

Admission is conservative: a request is admitted only if the KV pool can hold its whole future
(prompt + max_new_tokens, rounded up to pages, less its cached prefix) on top of what the
running requests may still need, so a decode step never runs out of memory and no request is
ever retracted or lost. With the radix cache, admission first matches the request's prompt in
the tree (whole pages, at most all but its last token: one token is always computed for its
logits; for a request that scores its prompt, at most up to `logprob_start_len`), locks the
matched path, and, when the pool is short, evicts unlocked cached prefixes (least recently used
first) before it makes the request wait.

With a hybrid pool (sliding-window layers in their own pool, `SWARadixCache`) both pools are
counted. A running request may still allocate window slots up to its cap: its own window
(`swa_tokens_per_request`) plus, with the cache, the tree's window pages it locks (at most one
more window); it holds its own pages and its locked ones. Tree window pages no request locks
count as free (they are tombstoned when an allocation needs them: `ScheduleBatch.
_make_swa_room`). Moving pages between a request and the tree never changes that budget, so a
step never runs out of window slots. A waiting request needs window slots for the prompt it
computes during its prefill, and at least its cap less what it locks at admission.

Chunked prefill (`chunked_prefill_size`): a request whose prompt past its cached prefix is longer
than one chunk is admitted alone and computed a chunk per step (`chunked_prefill.py`); a request
that scores its prompt (input logprobs) is computed whole.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

from srt.managers.req import Req
from srt.managers.schedule_batch import pages_needed
from srt.managers.scheduler_logprobs import wants_input_logprobs
from srt.mem_cache.kv_memory import swa_tokens_per_request
from srt.mem_cache.radix_cache import MatchResult, RadixCache, RadixKey
from srt.mem_cache.swa_radix_cache import SWAMatchResult, SWARadixCache

logger = logging.getLogger(__name__)

# A waiting request that shares this many more tokens with a request admitted in the same
# prefill batch than with the tree waits one step: once the other's prompt is inserted (after
# its prefill) it matches them instead of computing them a second time (SGLang's in-batch
# prefix caching check uses the same 32).
IN_BATCH_PREFIX_THRESHOLD = 32


class InBatchPrefixes:
    """The prompts admitted into one prefill batch, as chained hashes of their first blocks
    (one block: `block` tokens, whole pages), to find how much of a candidate's prompt one of
    them shares. A hash collision only defers a request by one step. Both sides hash lazily:
    the admitted prompts only as deep as a candidate's walk has reached (with no shared
    prefix, one block each), a candidate until its first miss."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.seen: set[tuple[str | None, int, int]] = set()  # (extra_key, blocks, chain hash)
        self._added: list[tuple[Req, Iterator[int]]] = []  # and their chains' rest
        self._depth = 0  # blocks of every added prompt in `seen`

    def _chain(self, req: Req, limit: int) -> Iterator[int]:
        """The chained hashes of the prompt's whole blocks, lazily (a miss stops the walk)."""
        ids, b, h = req.origin_input_ids, self.block, 0
        for j in range(min(limit, len(ids)) // b):
            h = hash((h, tuple(ids[j * b : (j + 1) * b])))
            yield h

    def _hash_added(self, req: Req, chain: Iterator[int], start: int, depth: int) -> None:
        for j in range(start, depth):
            h = next(chain, None)
            if h is None:  # a shorter prompt: nothing deeper
                return
            self.seen.add((req.extra_key, j, h))

    def shared_len(self, req: Req, limit: int) -> int:
        """Tokens (whole blocks, at most `limit`) of req's prompt that an added prompt shares."""
        n = 0
        for j, h in enumerate(self._chain(req, limit)):
            if j >= self._depth:  # the added prompts' next block, all of them
                for added, chain in self._added:
                    self._hash_added(added, chain, j, j + 1)
                self._depth = j + 1
            if (req.extra_key, j, h) not in self.seen:
                break
            n = (j + 1) * self.block
        return n

    def add(self, req: Req) -> None:
        chain = self._chain(req, len(req.origin_input_ids))
        self._hash_added(req, chain, 0, self._depth)
        self._added.append((req, chain))


class SchedulePolicy:
    """Admission control over one ModelRunner's pools (and its radix cache, if any).

    Parameters
    ----------
    model_runner : ModelRunner (allocator, `max_total_num_tokens`, `max_running_requests`,
        `server_args`: disable_radix_cache, chunked_prefill_size).
    page_size : tokens per KV page.
    sliding_window_size : the hybrid pool's window-left (0: a uniform pool).
    max_prefill_tokens : most prompt tokens computed in one prefill batch (a longer single
        prompt still runs alone).

    Attributes
    ----------
    tree_cache : the RadixCache (SWARadixCache on a hybrid pool), or None
        (disable_radix_cache, no ServerArgs).
    chunked_prefill_size : tokens of a prompt computed per step (0: whole prompts).
    decode_chunk_size : the same while other requests decode (<= chunked_prefill_size).
    """

    def __init__(
        self,
        model_runner: Any,
        page_size: int,
        sliding_window_size: int,
        max_prefill_tokens: int,
    ) -> None:
        self.runner = model_runner
        self.page_size = page_size
        self.is_swa = hasattr(model_runner.token_to_kv_pool_allocator, "swa_available_size")
        self.sliding_window_size = sliding_window_size
        self.max_prefill_tokens = max_prefill_tokens
        self.args = args = getattr(model_runner, "server_args", None)  # None: a bare runner
        self.tree_cache = self._tree_cache(args)
        chunk = getattr(args, "chunked_prefill_size", None) or 0
        self.chunked_prefill_size = max(chunk, 0)
        decode_chunk = getattr(args, "decode_chunked_prefill_size", None) or 0
        self.decode_chunk_size = (
            min(decode_chunk, self.chunked_prefill_size)
            if decode_chunk > 0
            else self.chunked_prefill_size
        )
        # window slots one running request may hold outside its prefill (hybrid pool only)
        self.swa_slots_per_request = (
            swa_tokens_per_request(sliding_window_size, page_size) if self.is_swa else 0
        )

    def _tree_cache(self, args: Any) -> RadixCache | None:
        """The prefix cache, unless disable_radix_cache (or no ServerArgs: a bare runner)."""
        if args is None or getattr(args, "disable_radix_cache", True):
            return None
        runner = self.runner
        r2t, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
        if self.is_swa:
            return SWARadixCache(r2t, alloc, self.page_size, self.sliding_window_size)
        return RadixCache(r2t, alloc, self.page_size)

    def needs_chunks(self, req: Req) -> bool:
        """Whether the request's prompt past its cached prefix (`kv_len`) is computed over
        several steps."""
        rest = len(req.origin_input_ids) - req.kv_len
        return 0 < self.chunked_prefill_size < rest and not wants_input_logprobs(req)

    def slots_for(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size) * self.page_size

    def _swa_slots_cap(self, req: Req) -> int:
        """Window slots the request may hold at once after its prefill: its own window, and
        with the cache the tree's window pages it locks (at most a window of its prompt)."""
        own = min(self.slots_for(req.target_len()), self.swa_slots_per_request)
        if self.tree_cache is None:
            return own
        return own + min(self.slots_for(len(req.origin_input_ids)), self.swa_slots_per_request)

    def _swa_slots_to_admit(self, req: Req) -> int:
        """Window slots a request may need with nothing cached: its whole prompt while it is
        prefilled, its cap afterwards."""
        return max(self.slots_for(len(req.origin_input_ids)), self._swa_slots_cap(req))

    def _swa_locked_slots(self, prefix_len: int) -> int:
        """Window slots of the tree that a request with a cached prefix of prefix_len tokens
        (whole pages) locks: those of the prefix's last W tokens."""
        lo = max(0, prefix_len - self.sliding_window_size) // self.page_size
        return prefix_len - lo * self.page_size

    def _swa_own_slots(self, req: Req) -> int:
        """Window slots the request owns (its swa_pages past its cached prefix)."""
        tree = max(0, req.cache_protected_len // self.page_size - req.swa_page_start)
        return max(0, len(req.swa_pages) - tree) * self.page_size

    def _swa_slots_total(self, req: Req) -> int:
        """Most window slots the request holds at once (own and locked) from here on: while
        its prompt is computed, its prompt past the prefix it was admitted with (own pages
        never lie outside that) and the lock of that prefix; afterwards its cap."""
        if req.kv_len >= len(req.origin_input_ids):
            return self._swa_slots_cap(req)
        rest = self.slots_for(len(req.origin_input_ids) - req.cached_tokens)
        return max(rest + self._swa_locked_slots(req.cached_tokens), self._swa_slots_cap(req))

    def check_fits(self, req: Req) -> None:
        """Raise ValueError if the request could never fit in the KV pool or the context."""
        need = self.slots_for(req.target_len())
        total = self.runner.max_total_num_tokens
        if need > total:
            raise ValueError(
                f"request {req.rid} needs {need} KV slots (prompt {len(req.origin_input_ids)}"
                f" + max_new_tokens {req.sampling_params.max_new_tokens}) but the KV pool holds"
                f" {total}; raise max_total_tokens or lower max_new_tokens"
            )
        if self.is_swa:
            need = self._swa_slots_to_admit(req)
            total = self.runner.token_to_kv_pool_allocator.size_swa
            if need > total:
                raise ValueError(
                    f"request {req.rid} needs {need} sliding-window KV slots for its prompt of"
                    f" {len(req.origin_input_ids)} tokens but the window pool holds {total}"
                )

    def reserved_slots(self, running: list[Req]) -> int:
        """Slots the running requests may still allocate before they finish."""
        return sum(self.slots_for(r.target_len()) - self.slots_for(r.kv_len) for r in running)

    def _reserved_swa_slots(self, running: list[Req]) -> int:
        """Window slots the running requests may still allocate (hybrid pool)."""
        return sum(
            max(
                0,
                self._swa_slots_total(r)
                - self._swa_own_slots(r)
                - self._swa_locked_slots(r.cache_protected_len),
            )
            for r in running
        )

    def _free_swa_slots(self) -> int:
        """Window slots free or held by the tree unlocked (tombstoned on demand)."""
        tree = self.tree_cache
        free = self.runner.token_to_kv_pool_allocator.swa_available_size()
        return free + (tree.swa_evictable_size() if isinstance(tree, SWARadixCache) else 0)

    def match_prefix(self, req: Req) -> MatchResult | None:
        """The request's cached prefix, locked (None: no cache or nothing matched)."""
        tree = self.tree_cache
        if tree is None:
            return None
        n = len(req.origin_input_ids) - 1  # one token is always computed (its logits)
        if wants_input_logprobs(req):
            n = min(n, req.logprob_start_len)  # the scored tokens are computed
        m = tree.match_prefix(RadixKey(tuple(req.origin_input_ids[:n]), req.extra_key))
        if m.prefix_len == 0:
            return None
        tree.inc_lock_ref(m.last_node)
        return m

    def _start_from(self, req: Req, m: MatchResult) -> None:
        """The admitted request starts from its matched prefix (and, on a hybrid pool, reads
        the tree's window pages of the prefix's last W tokens)."""
        req.kv_pages = list(m.pages)
        req.kv_len = req.cache_protected_len = m.prefix_len
        req.last_node = m.last_node
        if isinstance(m, SWAMatchResult):
            lo = max(0, m.prefix_len - self.sliding_window_size) // self.page_size
            req.swa_page_start, req.swa_pages = lo, list(m.swa_pages[lo:])

    def admit(self, waiting: deque[Req], running: list[Req], chunking: bool = False) -> list[Req]:
        """Pop the waiting requests that fit now, in order (FIFO: the first that does not fit
        stops admission, so none starves); each starts from its cached prefix, if any. A
        request prefilled in chunks is admitted alone. With the cache, a request that shares a
        prefix with one admitted in this batch (`IN_BATCH_PREFIX_THRESHOLD` tokens more than
        the tree holds) also stops admission: the next step it matches that prefix. While a
        prompt is prefilled in chunks (`chunking`), a request that would be chunked too waits
        (one chunked prompt at a time) and stops admission."""
        allocator = self.runner.token_to_kv_pool_allocator
        free = allocator.available_size() - self.reserved_slots(running)
        held_swa = self._reserved_swa_slots(running) if self.is_swa else 0  # running + admitted
        rows = self.runner.max_running_requests - len(running)
        admitted: list[Req] = []
        prefill_tokens = 0
        block = pages_needed(IN_BATCH_PREFIX_THRESHOLD, self.page_size) * self.page_size
        in_batch = InBatchPrefixes(block) if self.tree_cache is not None else None
        while waiting and len(admitted) < rows:
            req = waiting[0]
            m = self.match_prefix(req)
            cached = m.prefix_len if m is not None else 0
            if admitted and in_batch is not None:
                limit = len(req.origin_input_ids) - 1
                if in_batch.shared_len(req, limit) >= cached + block:  # next step it hits
                    if m is not None:
                        self.tree_cache.dec_lock_ref(m.last_node)  # type: ignore[union-attr]
                    break
            need = self.slots_for(req.target_len()) - cached
            n = len(req.origin_input_ids) - cached
            need_swa = free_swa = 0
            if self.is_swa:  # (after the match's lock: its pages are no longer evictable)
                req.cached_tokens = cached
                need_swa = self._swa_slots_total(req) - self._swa_locked_slots(cached)
                free_swa = self._free_swa_slots() - held_swa
            long = 0 < self.chunked_prefill_size < n and not wants_input_logprobs(req)
            fits = not admitted or (prefill_tokens + n <= self.max_prefill_tokens and not long)
            fits = fits and not (long and chunking)
            tree = self.tree_cache
            if tree is not None and fits and free < need <= free + tree.evictable_size():
                free += tree.evict(need - free)  # unlocked prefixes, LRU first, only to fit
            if not fits or need > free or need_swa > free_swa:
                if m is not None:
                    assert self.tree_cache is not None
                    self.tree_cache.dec_lock_ref(m.last_node)
                break
            waiting.popleft()
            if in_batch is not None:
                in_batch.add(req)
            if m is not None:
                self._start_from(req, m)
            req.cached_tokens = cached
            admitted.append(req)
            free -= need
            held_swa += need_swa
            prefill_tokens += n
            if long:
                break
        return admitted
