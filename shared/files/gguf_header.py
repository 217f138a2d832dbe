"""A GGUF file's first metadata values, read from its header with the standard library alone: what a command checks
before anything heavy loads (`up` refuses more stages than the model has layers in well under a second; the gguf
package's reader parses the whole header, vocabulary included, and needs numpy)."""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

from shared.errors import GgufError

# GGUF value types: struct format of the scalars; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GgufError(f"{f.name}: the GGUF header ends early (truncated file?)")
    return data


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8))
    return _read(f, n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    """The value of type `kind` at f's position (None when not `keep`: read past only)."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        (value,) = struct.unpack(fmt, _read(f, struct.calcsize(fmt)))
        return value
    if kind == STRING:
        return _string(f)
    if kind == ARRAY:
        item, count = struct.unpack("<IQ", _read(f, 12))
        if item in _SCALARS:  # skipped whole
            f.seek(count * struct.calcsize(_SCALARS[item]), 1)
            return None
        for _ in range(count):
            _value(f, item, keep=False)
        return None
    raise GgufError(f"{f.name}: unknown GGUF value type {kind} in its header")


def header_values(path: str, wanted: set[str]) -> dict[str, Any]:
    """The scalar and string metadata values named in `wanted` (arrays are skipped), reading no further than the last
    of them; GgufError for a file that is not GGUF."""
    found: dict[str, Any] = {}
    with open(path, "rb") as f:
        if _read(f, 4) != b"GGUF":
            raise GgufError(f"{path} is not a GGUF file (no GGUF magic at its start)")
        _version, _tensors, kvs = struct.unpack("<IQQ", _read(f, 20))
        for _ in range(kvs):
            key = _string(f)
            (kind,) = struct.unpack("<I", _read(f, 4))
            value = _value(f, kind, keep=key in wanted)
            if key in wanted:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found


def layer_count(path: str) -> int:
    """The model's layer count (`<architecture>.block_count`) from its header alone."""
    arch = header_values(path, {"general.architecture"}).get("general.architecture")
    key = f"{arch}.block_count"
    count = header_values(path, {key}).get(key) if arch else None
    if not isinstance(count, int):
        raise GgufError(f"model file {path}: its header names no layer count ({key if arch else 'no architecture'})")
    return count
