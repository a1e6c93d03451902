"""The KV write contract's debug check (srt/mem_cache/write_check.py): a batch may write only
slots of pages its own request holds, at the slot its page list names; every other target is
named in the error (the tree, another request, a free page, the padding page)."""

from __future__ import annotations

import pytest
import torch

from sgl_ext import settings
from srt.managers.schedule_batch import Req
from srt.mem_cache.write_check import (
    KVWriteViolation,
    check_kv_writes,
    check_padding_writes,
    kv_write_checks_enabled,
)
from srt.sampling.sampling_params import SamplingParams
from tests.conftest import gpu

PS = 4


def _req(rid: str, pages: list[int], kv_len: int, protected: int = 0) -> Req:
    r = Req(rid, [1] * kv_len, SamplingParams())
    r.kv_pages, r.kv_len, r.cache_protected_len = list(pages), kv_len, protected
    return r


def _slots(r: Req, first: int) -> list[int]:
    return [r.kv_pages[p // PS] * PS + p % PS for p in range(first, r.kv_len)]


def test_own_slots_pass_every_other_target_is_named():
    tree = [3, 4]
    a = _req("a", [3, 4, 7, 8], kv_len=14, protected=8)  # 8 cached tokens, 6 computed
    b = _req("b", [9], kv_len=2)
    other = _req("c", [3, 11], kv_len=6, protected=4)  # running, not in the batch
    good = _slots(a, 8) + _slots(b, 0)
    check_kv_writes(torch.tensor(good), [a, b], [6, 2], PS, tree, [other])
    check_kv_writes(torch.tensor([-1] * 6 + good[6:]), [a, b], [6, 2], PS, tree, [other])
    cases = {
        3 * PS + 1: "radix tree",  # a cached prefix's slot
        11 * PS: "request c",  # another running request's page
        9 * PS + 3: "request b",  # a batch neighbour's page
        20 * PS: "free page",
        2: "padding page",
        7 * PS + 3: "token 8's slot is 28",  # its own page, the wrong offset
    }
    for slot, what in cases.items():
        bad = [slot, *good[1:]]
        with pytest.raises(KVWriteViolation, match=f"request a would write slot {slot}.*{what}"):
            check_kv_writes(torch.tensor(bad), [a, b], [6, 2], PS, tree, [other])
    with pytest.raises(KVWriteViolation, match="7 slots for 8 new tokens"):
        check_kv_writes(torch.tensor(good[:7]), [a, b], [6, 2], PS, tree, [other])
    shared = _req("d", [4, 12], kv_len=5)  # claims a tree page as its own
    with pytest.raises(KVWriteViolation, match="page 4 is held by request d and by the radix"):
        check_kv_writes(torch.tensor(_slots(shared, 4)), [shared], [1], PS, tree)


def test_padding_rows_stay_in_the_padding_page():
    check_padding_writes(torch.tensor([0, 0, -1, PS - 1]), PS)
    with pytest.raises(KVWriteViolation, match="padding row would write slot 4"):
        check_padding_writes(torch.tensor([0, PS]), PS)


def test_enabled_by_sgl_ext_debug():
    with settings.override(debug=True):
        assert kv_write_checks_enabled()
    with settings.override(debug=False):
        assert not kv_write_checks_enabled()


@gpu
def test_padding_check_on_device_slots():
    """The CUDA-graph runner's padding rows live on the device (unrun on CI: no GPU)."""
    loc = torch.zeros(8, dtype=torch.int64, device="cuda")
    check_padding_writes(loc, 16)
    loc[3] = 16
    with pytest.raises(KVWriteViolation, match="slot 16"):
        check_padding_writes(loc, 16)
