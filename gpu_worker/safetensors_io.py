"""Reading and writing the safetensors format with NumPy alone.

Format: 8-byte little-endian header length N, N bytes of JSON header
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
offsets relative to the end of the header), then the raw little-endian tensor bytes.
NumPy has no bfloat16, so BF16 is read as uint16 and widened into the top half of a
float32 (exact), and written by rounding float32 to nearest-even.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

# safetensors dtype string -> NumPy storage dtype (BF16 is stored as uint16 bits).
STORAGE = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_NUMPY_TO_ST = {np.dtype(v): k for k, v in STORAGE.items()
                if k not in ("BF16", "F8_E4M3", "F8_E5M2")}
MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit


class SafetensorsError(ValueError):
    """A file that is not a valid safetensors file; the message names the file."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """Header of one safetensors file plus lazy, memory-mapped access to its tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise SafetensorsError(f"{self.path}: truncated file ({size} bytes, no header)")
                n = int.from_bytes(head, "little")
                if n > MAX_HEADER or 8 + n > size:
                    raise SafetensorsError(
                        f"{self.path}: truncated or corrupt: header length {n} but file has "
                        f"{size} bytes")
                raw = f.read(n)
        except OSError as exc:
            raise SafetensorsError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsError(f"{self.path}: corrupt header (not JSON: {exc})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: corrupt header (not a JSON object)")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._size = size
        self.tensors: dict[str, TensorInfo] = {
            name: self._parse_entry(name, entry) for name, entry in header.items()}
        self._map: np.memmap | None = None

    def _parse_entry(self, name: str, entry: object) -> TensorInfo:
        where = f"{self.path}: tensor {name}"
        if not isinstance(entry, dict):
            raise SafetensorsError(f"{where}: header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in STORAGE:
            raise SafetensorsError(f"{where}: unknown dtype {dtype!r}")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and d >= 0 for d in shape)):
            raise SafetensorsError(f"{where}: bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise SafetensorsError(f"{where}: bad data_offsets {offsets!r}")
        nbytes = offsets[1] - offsets[0]
        if nbytes != math.prod(shape) * STORAGE[dtype].itemsize:
            raise SafetensorsError(f"{where}: data_offsets span {nbytes} bytes, but shape "
                                   f"{tuple(shape)} of {dtype} needs "
                                   f"{math.prod(shape) * STORAGE[dtype].itemsize}")
        begin = self._data_start + offsets[0]
        if begin + nbytes > self._size:
            raise SafetensorsError(f"{where}: truncated file: data ends at byte "
                                   f"{begin + nbytes}, file has {self._size} bytes")
        return TensorInfo(name, dtype, tuple(shape), begin, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The stored values of `name` as a read-only memory-mapped view (BF16 as uint16)."""
        info = self.tensors[name]
        storage = STORAGE[info.dtype]
        if info.nbytes == 0:
            return np.zeros(info.shape, storage)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        flat = self._map[info.begin:info.begin + info.nbytes].view(storage)
        return flat.reshape(info.shape)

    def read(self, name: str, dtype: np.dtype | type = np.float32, *,
             rows: Sequence[int] | None = None, part: slice | None = None) -> np.ndarray:
        """`name` converted to a float NumPy dtype, as a new contiguous array.

        ``rows`` picks entries of the first axis, in the given order (e.g. some experts of
        a stacked [E, ...] tensor); ``part`` a contiguous range of the second axis (e.g. the
        gate rows of gate_up_proj [E, 2I, H]). The bytes come by pread, never through a
        mapping: they pass through the page cache but are not added to this process's
        resident set, and only the selected bytes are read.
        """
        info = self.tensors[name]
        if info.dtype not in FLOAT_DTYPES:
            raise SafetensorsError(f"{self.path}: tensor {name} has dtype {info.dtype}, "
                                   f"expected one of {', '.join(FLOAT_DTYPES)}")
        storage = STORAGE[info.dtype]
        shape, runs = self._runs(info, rows, part)
        # NOTE: read straight into the result when no conversion is needed
        direct = info.dtype != "BF16" and storage == np.dtype(dtype).newbyteorder("<")
        buf = np.empty(shape, np.dtype(dtype) if direct else storage)
        self._pread(buf.reshape(-1).view(np.uint8), runs, name)
        return buf if direct else to_float(buf, info.dtype, dtype)

    def _runs(self, info: TensorInfo, rows: Sequence[int] | None, part: slice | None
              ) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
        """Output shape and the (file offset, bytes) runs to read, in output order."""
        if rows is None and part is None:
            return info.shape, [(info.begin, info.nbytes)]
        if len(info.shape) < (2 if part is not None else 1):
            raise ValueError(f"{self.path}: tensor {info.name} {info.shape}: cannot select "
                             "rows or a part of it")
        item = STORAGE[info.dtype].itemsize
        n0, rest = info.shape[0], info.shape[1:]
        row = math.prod(rest) * item  # bytes of one entry of the first axis
        lo, inner, sub = 0, row, rest
        if part is not None:
            lo, hi, step = part.indices(rest[0])
            if step != 1:
                raise ValueError("part must be a contiguous slice")
            inner = math.prod(rest[1:]) * item  # bytes of one entry of the second axis
            sub = (hi - lo, *rest[1:])
        ids = range(n0) if rows is None else [int(r) for r in rows]
        if any(not 0 <= r < n0 for r in ids):
            raise ValueError(f"{self.path}: tensor {info.name}: rows must lie in [0, {n0})")
        seg = math.prod(sub) * item
        runs: list[tuple[int, int]] = []
        for r in ids:  # consecutive rows of whole entries merge into one read
            off = info.begin + r * row + lo * inner
            if runs and runs[-1][0] + runs[-1][1] == off:
                runs[-1] = (runs[-1][0], runs[-1][1] + seg)
            else:
                runs.append((off, seg))
        return (len(ids), *sub), runs

    def _pread(self, out: np.ndarray, runs: list[tuple[int, int]], name: str) -> None:
        """Fill the flat byte array ``out`` from the file's ``runs``, in order."""
        view = memoryview(out)
        pos = 0
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise SafetensorsError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            for off, size in runs:
                done = 0
                while done < size:  # a read may return less (2 GiB cap per call)
                    n = os.preadv(fd, [view[pos + done:pos + size]], off + done)
                    if n <= 0:
                        raise SafetensorsError(
                            f"{self.path}: tensor {name}: file ends at byte {off + done} "
                            "(truncated after it was opened?)")
                    done += n
                pos += size
        except OSError as exc:
            raise SafetensorsError(f"{self.path}: tensor {name}: cannot read: "
                                   f"{exc.strerror or exc}") from None
        finally:
            os.close(fd)


def to_float(raw: np.ndarray, st_dtype: str, dtype: np.dtype | type) -> np.ndarray:
    if st_dtype == "BF16":
        wide = raw.astype(np.uint32)
        wide <<= 16  # [..] bf16 bits into the top half of f32 (in place: no second temporary)
        return np.ascontiguousarray(wide.view(np.float32).astype(dtype, copy=False))
    return np.array(raw, dtype=dtype, order="C", copy=True)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest-even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(x)
    return np.where(nan, np.uint16(0x7FC0), rounded.astype(np.uint16))


def write_file(path: str | Path, tensors: Mapping[str, np.ndarray], *,
               dtype: str | None = None, metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` as one safetensors file.

    With `dtype` ("F32", "F16" or "BF16") every floating tensor is stored in that dtype;
    otherwise each array keeps its own dtype (an ``ml_dtypes.bfloat16`` array: BF16).
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        st_dtype = _NUMPY_TO_ST.get(arr.dtype.newbyteorder("<"))
        if dtype is not None and arr.dtype.kind == "f":
            st_dtype = dtype
        if arr.dtype.name == "bfloat16":  # ml_dtypes.bfloat16: its bits as they are
            st_dtype, data = "BF16", np.ascontiguousarray(arr).view(np.uint16).tobytes()
        elif st_dtype == "BF16":
            data = bf16_bits(arr).tobytes()
        elif st_dtype in STORAGE and st_dtype not in ("F8_E4M3", "F8_E5M2"):
            data = np.ascontiguousarray(arr, dtype=STORAGE[st_dtype]).tobytes()
        else:
            raise ValueError(f"cannot store tensor {name} of dtype {arr.dtype} as {st_dtype}")
        header[name] = {"dtype": st_dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the reference writer aligns the data to 8 bytes
    with Path(path).open("wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)
