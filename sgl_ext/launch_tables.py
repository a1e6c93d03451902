"""The measured launch tables, kept as data: one JSON file per table in `sgl_ext/tables/`, read
by this one loader.

    rope_kv.json   RoPE + KV layouts (rope_kv_plan.launch_config)
    qk_norm.json   the q/k-norm op's layouts (rope_kv_plan.qk_norm_launch_config)
    gemm.json      decode linears on the skinny Triton GEMM (srt/layers/gemm_choice.py)
    moe.json       the routed-expert kernels (srt/layers/moe/fused_moe_triton/config.py)

A file is {"about": ..., "rows": [...], "devices": {...}}:
- "about": what the table chooses and how its rows are read;
- "rows": the H100's rows, which every GPU takes unless its own say otherwise;
- "devices" (optional): {"H200": [rows]}: a GPU whose name (`torch.cuda.get_device_name`)
  contains the key takes that section's rows before "rows" (`device_tables`).
A row is an object of named values; "note" (optional) is one line saying why the row is there,
pointing at its measurement (benchmarks/RESULTS.md 8). Token ranges are "tokens": [first, last]
(last null: no bound); in "rows" each kind of call's ranges run from 1 with no gap or overlap.

`load(name, parse_row, check)` reads a file on first use, parses every row (a bad one is a
ValueError naming the file and the row), checks each section and caches the result; nothing is
read at import. `override(name, data)` puts other data in a file's place for a `with` block
(tests, tuners); `row_line` prints a row as a file holds it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import torch

from sgl_ext import settings
from sgl_ext.device_tables import device_tables

R = TypeVar("R")
TABLES_DIR = Path(__file__).with_name("tables")
MAX_NOTE = 160  # characters of a row's note
_TOP_KEYS = ("about", "rows", "devices")


@dataclass(frozen=True, eq=False)
class LaunchTable(Generic[R]):
    """A loaded table: `rows` (the H100's) and `devices` (a GPU's own rows, by a substring of
    its name), each row as the table's parser made it. Hashed by identity (a reload is a new
    table), so callers may cache what they derive from one."""

    name: str
    path: str
    rows: tuple[R, ...]
    devices: Mapping[str, tuple[R, ...]]

    def device_rows(self, device: torch.device | None) -> tuple[R, ...]:
        """The rows of every `devices` section whose key occurs in `device`'s GPU name, in file
        order; none for no device, off CUDA or without a GPU."""
        if not self.devices:
            return ()
        return tuple(r for rows in device_tables(self.devices, device) for r in rows)

    def rows_for(self, device: torch.device | None) -> tuple[R, ...]:
        """The rows a call on `device` reads, in order: its GPU's own, then the H100's."""
        own = self.device_rows(device)
        return own + self.rows if own else self.rows


_cache: dict[tuple[str, Callable, Callable | None], LaunchTable] = {}
_overrides: dict[str, Mapping[str, Any]] = {}


def table_path(name: str) -> Path:
    """The file of table `name`."""
    return TABLES_DIR / f"{name}.json"


def read(name: str) -> dict[str, Any]:
    """Table `name`'s data as its file holds it (or as `override` replaced it)."""
    if name in _overrides:
        return json.loads(json.dumps(_overrides[name]))  # a copy
    path = table_path(name)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"no launch table {name!r}: {path} is missing") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    return data


def load(
    name: str,
    parse_row: Callable[[dict[str, Any]], R],
    check: Callable[[tuple[R, ...], str | None], None] | None = None,
) -> LaunchTable[R]:
    """Table `name`, read and checked on first use, then cached.

    parse_row(row) builds one row's value from a copy of the row's object without its note
    (it may pop the keys it reads); it raises ValueError / TypeError for a bad row.
    check(rows, device) checks a section ("rows": device None; a `devices` section: its key),
    raising ValueError.
    """
    key = (name, parse_row, check)
    table = _cache.get(key)
    if table is None:
        table = _cache[key] = _build(name, parse_row, check)
    return table


def _build(name: str, parse_row: Callable, check: Callable | None) -> LaunchTable:
    where = str(table_path(name)) + (" (override)" if name in _overrides else "")
    data = read(name)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{where}: a table is an object with a list of 'rows'")
    extra = sorted(set(data) - set(_TOP_KEYS))
    if extra:
        raise ValueError(f"{where}: unknown key {extra[0]!r} (a table has {', '.join(_TOP_KEYS)})")
    devices = data.get("devices", {})
    if not isinstance(devices, dict) or not all(
        isinstance(k, str) and k and isinstance(v, list) for k, v in devices.items()
    ):
        raise ValueError(f"{where}: 'devices' maps a GPU name's substring to a list of rows")
    sections: dict[str | None, tuple] = {}
    for dev, rows in ((None, data["rows"]), *devices.items()):
        label = "rows" if dev is None else f"devices[{dev!r}]"
        parsed = tuple(_row(where, f"{label}[{i}]", r, parse_row) for i, r in enumerate(rows))
        if check is not None:
            try:
                check(parsed, dev)
            except (ValueError, TypeError) as err:
                raise ValueError(f"{where}: {label}: {err}") from None
        sections[dev] = parsed
    own = {k: v for k, v in sections.items() if k is not None}
    return LaunchTable(name, where, sections[None], MappingProxyType(own))


def _row(where: str, label: str, row: object, parse_row: Callable) -> object:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: {label}: a row is an object, got {row!r}")
    fields = dict(row)
    note = fields.pop("note", None)
    try:
        if note is not None and (not isinstance(note, str) or "\n" in note or len(note) > MAX_NOTE):
            raise ValueError(f"a note is one line of at most {MAX_NOTE} characters")
        return parse_row(fields)
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{where}: {label} {json.dumps(row)}: {err}") from None


@contextlib.contextmanager
def override(name: str, data: Mapping[str, Any]) -> Iterator[None]:
    """Read `data` (what table `name`'s file would hold) instead of the file inside a `with`
    block: tests, tuners. It is checked when first loaded. The ops' cached launch plans are
    dropped on the way in and out (settings listeners)."""
    before = _overrides.get(name)
    _overrides[name] = data
    _changed(name)
    try:
        yield
    finally:
        if before is None:
            del _overrides[name]
        else:
            _overrides[name] = before
        _changed(name)


def _changed(name: str) -> None:
    for key in [k for k in _cache if k[0] == name]:
        del _cache[key]
    settings.set_fields()  # no field changes; the listeners drop what was planned


def row_line(row: Mapping[str, Any]) -> str:
    """One row as a table file writes it: a JSON object on one line."""
    return json.dumps(dict(row), separators=(", ", ": "))


# --------------------------------------------------------------------- row helpers for parsers


def take(row: dict[str, Any], key: str, *kinds: type) -> Any:
    """Pop `key` from a row being parsed, checking its JSON type (an int is not a bool)."""
    if key not in row:
        raise ValueError(f"missing {key!r}")
    v = row.pop(key)
    if kinds and (not isinstance(v, kinds) or (bool not in kinds and isinstance(v, bool))):
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ValueError(f"{key} must be {names}, got {v!r}")
    return v


def no_more(row: Mapping[str, Any]) -> None:
    """A parser's last word: every key of the row was read."""
    if row:
        raise ValueError(f"unknown key {sorted(row)[0]!r}")


def token_range(row: dict[str, Any]) -> tuple[int, int | None]:
    """Pop a row's "tokens": [first, last] (last None: no bound), first >= 1, last >= first."""
    v = take(row, "tokens", list)
    ok = len(v) == 2 and isinstance(v[0], int) and not isinstance(v[0], bool) and v[0] >= 1
    last = v[1] if ok else None
    if ok and last is not None:
        ok = isinstance(last, int) and not isinstance(last, bool) and last >= v[0]
    if not ok:
        raise ValueError(f"tokens must be [first, last] with 1 <= first <= last or last null: {v}")
    return v[0], last


def check_ranges(
    ranges: Iterable[tuple[Hashable, int, int | None]], cover: bool, what: str = "calls"
) -> None:
    """Token ranges (group, first, last) in file order: per group increasing with no overlap;
    with `cover`, also from 1 with no gap and the last one unbounded (every call has a row)."""
    seen: dict[Hashable, tuple[int, int | None]] = {}
    for group, first, last in ranges:
        prev = seen.get(group)
        if prev is None:
            if cover and first != 1:
                raise ValueError(f"{what} {group}: the first range starts at {first}, not 1")
        else:
            end = prev[1]
            if end is None or first <= end:
                raise ValueError(f"{what} {group}: tokens from {first} overlap or precede {prev}")
            if cover and first != end + 1:
                raise ValueError(f"{what} {group}: no row for tokens {end + 1}..{first - 1}")
        seen[group] = (first, last)
    if cover:
        for group, (_, last) in seen.items():
            if last is not None:
                raise ValueError(f"{what} {group}: no row past {last} tokens (last: null)")
