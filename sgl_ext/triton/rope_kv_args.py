"""The bundles rope_kv_kernel passes to its helpers (key_value.py, qk_norm.py): named tuples of
the values that travel together, built once in the kernel.

A tuple only groups values while Triton traces the kernel (it adds no IR), so the kernel
compiles to the same code as with every value passed on its own. Two kinds:

- runtime bundles (pointers, strides, sizes, tiles): ordinary variables;
- `Flags`, the kernel's compile-time configuration, bound as `cfg: tl.constexpr = Flags(...)`
  (a plain assignment would turn its values into tensors: Triton materialises the constants of
  an assigned tuple) and read as `cfg.NAME` (an expression, never a plain assignment, keeps a
  field constexpr).
"""

from __future__ import annotations

from collections import namedtuple

# A paged KV-cache buffer [pages, page, heads, dim]: its pointer and element strides.
PagedBuffer = namedtuple("PagedBuffer", "ptr page_stride off_stride head_stride")
# Both cache buffers and the slot count (slots outside [0, num_slots) are never written).
KVCache = namedtuple("KVCache", "k v num_slots")
# A per-token input [T, heads, dim] (query, key or value): its pointer and element strides.
TokenHeads = namedtuple("TokenHeads", "ptr tok_stride head_stride")
# A cache scale: the device tensor's pointer and the float (Flags' *_SCALE_MODE says which).
Scale = namedtuple("Scale", "ptr f")
# What a key/value block reads besides the cos/sin row: K and V, the token's slot (loc_ptr),
# the scales, the head count and the key's norm weights (QK_NORM).
KVSource = namedtuple("KVSource", "k v loc_ptr k_scale v_scale num_heads norm_w_ptr")
# The token's cos/sin row (see key_value.cos_sin): the row or the table, the position's address
# or the position, the table's row stride and its row count.
CosSinRow = namedtuple("CosSinRow", "row pos_at stride max_pos")
# A program's token t and its pair columns c [1, BLOCK_HALF] with their mask.
Tile = namedtuple("Tile", "t c c_ok")
# A query block (qk_norm.py): its rows [BH, 1], the rotary pairs' mask, the pass-through dims
# dt [1, BLOCK_TAIL] and their mask.
QueryRows = namedtuple("QueryRows", "row mask dt t_mask")
# A key/value block's loads (key_value_in) for key_value_out: heads, K rows and pair mask, V
# dims and mask, K pass-through dims and mask, slot, V, scales, K tail and pairs.
KVBlock = namedtuple("KVBlock", "kh k_row km dv dv_mask dt t_mask loc v k_s v_s k_tail ka kb")
# The kernel's constexpr configuration (rope_kv_kernel's parameters of the same names; HALF =
# ROT_DIM // 2; W_PRE: the norm weights loaded before the PDL wait).
Flags = namedtuple(
    "Flags",
    "PAGE_SIZE HEAD_DIM V_HEAD_DIM ROT_DIM HALF BLOCK_HALF BLOCK_TAIL BLOCK_DV BLOCK_HKV"
    " PAIR_MODE KBUF_PAIR_MODE IS_BF16 ROTATE WRITE_KV K_SCALE_MODE V_SCALE_MODE K_FP8_MAX"
    " V_FP8_MAX EMULATE_FP8 QK_NORM SS_FP64 POS_LAST W_PRE SLOT_PRE",
)
