"""GgufLoader: open a GGUF file memory-mapped; read metadata, tokenizer, chat template, and the tensors of one
layer range. It constructs no model (that is `shared.models`), it only hands out what the file holds."""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from shared.errors import GgufError, UnsupportedTensorType
from shared.files.layers import LayerRange, StagePosition

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_PLAIN_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
_HASH_HEAD_BYTES = 1 << 20


@dataclass(frozen=True)
class RawTensor:
    """One GGUF tensor as stored: `rows` rows of bytes (a matrix's rows are its output features); shape in torch
    order, e.g. attn_q.weight (out_features, in_features); decoding is shared.models.linear's job."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    data: torch.Tensor  # uint8 [rows, row_bytes]


@functools.cache
def supported_tensor_types() -> list[str]:
    """Every tensor type we can decode: the plain ones plus every quant the `gguf` package implements."""
    from gguf import quants

    quantized = [t.name for t in GGMLQuantizationType if t in quants._type_traits]
    return sorted({t.name for t in _PLAIN_TYPES} | set(quantized))


class _PlainArrayReader(GGUFReader):
    """gguf's GGUFReader with its header read faster, the same fields and tensors (tests/test_tiny_models.py compares
    them with the library's own reader). The library parses an array element by element through np.memmap slices;
    a vocabulary's strings and scores took it seconds, more the larger the vocabulary (Gemma 3's 262k tokens), on
    every process start. Here:

    - reads go through a plain ndarray view of the memory map (np.memmap's slicing hooks were most of the time);
    - an array of numbers is one part holding all of them (the library: a part per element), which contents()
      reads the same way;
    - an array of strings is a part per string's bytes, cut in one loop (the library also keeps each length as a
      part of its own; contents() reads only the bytes). A string past the end of the file is an error, as the
      library's IndexError was."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self._plain
        count, item = int(count), np.dtype(dtype)
        arr = plain[offset:offset + item.itemsize * count].view(item)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    @functools.cached_property
    def _plain(self) -> np.ndarray:
        return self.data.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":  # scalars; a file of the other byte order
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if len(raw_itype) != 1 or len(count) != 1:
            raise ValueError(f"an array header at byte {orig_offs} runs past the end of the file")
        item_type, n, offs = GGUFValueType(raw_itype[0]), int(count[0]), orig_offs + 12
        number = self.gguf_scalar_to_np.get(item_type)
        if number is not None:
            values = self._get(offs, number, n)
            if len(values) != n:
                raise ValueError(f"an array of {n} numbers at byte {orig_offs} runs past the end of the file")
            return 12 + int(values.nbytes), [raw_itype, count, values], [2], [GGUFValueType.ARRAY, item_type]
        if item_type != GGUFValueType.STRING:  # arrays of arrays: the library's way
            return super()._get_field_parts(orig_offs, raw_type)
        plain, size = self._plain, len(self._plain)
        if n > (size - offs) // 8:
            raise ValueError(f"an array of {n} strings at byte {orig_offs} runs past the end of the file")
        header = memoryview(plain)
        parts: list[np.ndarray] = [raw_itype, count]
        for _ in range(n):
            length = int.from_bytes(header[offs:offs + 8], "little")
            end = offs + 8 + length
            if end > size:
                raise ValueError(f"a string at byte {offs} runs past the end of the file")
            parts.append(plain[offs + 8:end])
            offs = end
        return offs - orig_offs, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, item_type]


@functools.lru_cache(maxsize=8)
def _parse(path: str, identity: tuple[int, ...]) -> tuple[GGUFReader, dict[str, ReaderTensor], Mapping]:
    """The header of the file at `path` as it is now (`identity`: its inode, size and mtime, so a rewritten file is
    parsed again): the reader, its tensors by name, its metadata. Cached per process because the gguf package parses
    a 49k-token vocabulary string by string (of the order of a second) and one process often opens a file more than
    once."""
    try:
        reader = _PlainArrayReader(path, "r")
    except Exception as e:  # the gguf package raises bare ValueError/IndexError/struct errors from deep inside
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GgufError(f"{path} is not a readable GGUF file (corrupt or truncated?): {detail}") from None
    size = identity[2]
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GgufError(f"{path} is truncated: tensor {t.name} ends past the end of the file")
    meta = _Metadata(path, {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")})
    if "general.architecture" not in meta:
        raise GgufError(f"{path} has no general.architecture key; is it a model GGUF?")
    return reader, {t.name: t for t in reader.tensors}, meta


class _Metadata(Mapping):
    """A file's metadata by key. Scalars are read at open (a bad one is an error there); an array is read when it is
    first asked for: the vocabulary's ~100k strings cost a tenth of a second a file, and loading layers never reads
    them. An array that cannot be read raises GgufError naming its key, as a scalar does at open."""

    def __init__(self, path: str, fields: dict[str, Any]):
        self._path, self._fields = path, fields
        self._values: dict[str, Any] = {}
        for key, field in fields.items():
            if field.types[:1] != [GGUFValueType.ARRAY]:
                self._values[key] = self._read(key)

    def _read(self, key: str) -> Any:
        try:
            return self._fields[key].contents()
        except Exception as e:
            raise GgufError(f"{self._path}: metadata key {key!r} cannot be read ({e})") from None

    def __getitem__(self, key: str) -> Any:
        if key not in self._values:
            if key not in self._fields:
                raise KeyError(key)
            self._values[key] = self._read(key)  # the same value whichever thread reads it first
        return self._values[key]

    def __iter__(self):
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


class GgufLoader:
    """A GGUF file, memory-mapped. Tensor bytes are only touched when a tensor is loaded."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise GgufError(f"{self.path}: no such file; pass a .gguf path or a known model name such as 'smollm2'")
        st = os.stat(self.path)
        self._reader, self._tensors, self._metadata = _parse(
            self.path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    # ---- metadata -------------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return str(self._metadata["general.architecture"])

    def get(self, key: str, default: Any = None) -> Any:
        return self._metadata.get(key, default)

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """Architecture-scoped key: arch_get('block_count') reads '<arch>.block_count'."""
        return self._metadata.get(f"{self.architecture}.{suffix}", default)

    @property
    def chat_template(self) -> str | None:
        return self._metadata.get("tokenizer.chat_template")

    @property
    def model_name(self) -> str:
        return str(self._metadata.get("general.name") or os.path.basename(self.path))

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 over the header (metadata + tensor table) and the first MiB of data, plus the file size:
        cheap, and different for any two files that could be mistaken for each other in one pipeline."""
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            h.update(f.read(self._reader.data_offset + _HASH_HEAD_BYTES))
        h.update(str(os.path.getsize(self.path)).encode())
        return h.hexdigest()[:16]

    # ---- tensors --------------------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in torch order (rows first), e.g. attn_q.weight -> (out_features, in_features)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def names_for(self, layers: LayerRange, position: StagePosition) -> list[str]:
        """The tensor names one stage needs: its blocks, plus token_embd (first) and output_norm + output
        (last; token_embd when the output is tied to the embedding; their biases where the file has them)."""
        names = [n for n in self._tensors if (m := _BLOCK_RE.match(n)) and int(m.group(1)) in range(layers.start, layers.stop)]
        if position.has_embedding:
            names.append("token_embd.weight")
        if position.has_lm_head:
            names.append("output_norm.weight")
            names.append("output.weight" if "output.weight" in self._tensors else "token_embd.weight")
            names += [n for n in ("output_norm.bias", "output.bias") if n in self._tensors]
        return list(dict.fromkeys(names))

    def tensor_bytes(self, names: list[str]) -> int:
        """The bytes these tensors take in the file."""
        return sum(int(self._tensors[n].n_bytes) for n in names)

    def raw(self, name: str, mapped: bool = False) -> RawTensor:
        """One tensor's bytes as stored, shape in torch order: copied out of the map, or with mapped=True a
        read-only view of it (pages are read, and held, only where touched: an embedding table). Types we cannot
        decode are refused here, before anything is built from them."""
        t = self._decodable(name)
        shape = self.tensor_shape(name)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        if not mapped:
            data = data.copy()
        with warnings.catch_warnings():  # torch warns that the map is read-only; nothing ever writes through it
            warnings.simplefilter("ignore", UserWarning)
            return RawTensor(name, t.tensor_type.name, shape, torch.from_numpy(data))

    def _decodable(self, name: str) -> ReaderTensor:
        try:
            t = self._tensors[name]
        except KeyError:
            raise GgufError(f"{self.path} has no tensor {name!r}") from None
        if t.tensor_type.name not in supported_tensor_types():
            raise UnsupportedTensorType(
                f"{self.path}: tensor {name} has type {t.tensor_type.name}, which stagemesh cannot decode; "
                f"supported types: {', '.join(supported_tensor_types())} (requantize the file with llama.cpp's "
                "llama-quantize to one of them)"
            )
        return t

    def release_pages(self) -> None:
        """Unmap the file's pages this process has read (they stay in the OS's page cache, and a later read, such as
        an embedding row, maps its page again). Loading reads each tensor of a piece once through the map; without this
        the piece's whole share of the file stays in the process's resident set beside the weights built from it."""
        mm = getattr(self._reader.data, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_DONTNEED)

    def tensors_on_demand(self, names: list[str]) -> PieceTensors:
        """names' tensors as a mapping that copies each out of the map when it is looked up (PieceTensors)."""
        return PieceTensors(self, names)



class PieceTensors(Mapping[str, RawTensor]):
    """A stage's tensors by name, each copied out of the file's map when looked up and kept only while it is among the
    last few looked up (an expert loop reads gate, up and down in turn). Loading builds each weight from its tensor and
    drops the copy, so at most a few tensors' bytes sit beside what has been built: a stage's peak memory while it loads
    is its weights, not its weights plus its share of the file (in copies or in pages of the map). Type and shape come
    from the file's index (no copy)."""

    KEEP = 3

    def __init__(self, loader: GgufLoader, names: list[str]):
        """Every name is checked here, before anything is built: a missing tensor or a type that cannot be decoded is
        refused at once (GgufError / UnsupportedTensorType), not after minutes of loading."""
        self._loader, self._names = loader, list(dict.fromkeys(names))
        for name in self._names:
            loader._decodable(name)
        self._kept: dict[str, RawTensor] = {}

    def __getitem__(self, name: str) -> RawTensor:
        if name not in self._names:
            raise KeyError(name)
        if (kept := self._kept.pop(name, None)) is None:
            kept = self._loader.raw(name)
            self._loader.release_pages()  # the copy is made: its pages of the map need not stay in this process
        self._kept[name] = kept  # most recent last
        while len(self._kept) > self.KEEP:
            del self._kept[next(iter(self._kept))]
        return kept

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def type_and_shape(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self._loader.tensor_type(name), self._loader.tensor_shape(name)

    def release(self) -> None:
        self._kept.clear()
