"""Partition state in files, so that only handles and messages travel through a Beam graph.

Elements of our pipelines are whole columnar partitions. Their arrays are written into files under
OUTPUT/_work/ and a handle (a path, or for a bulk exchange a (path, offset, length) slice) travels
in their place.

A file is Arrow IPC, never pickle: reading one parses JSON and Arrow buffers and builds only the
types `encode` names (containers, numpy and Arrow arrays, the listed dataclasses), so a file that
someone else wrote into OUTPUT can make a run fail but cannot run code in it. Layout: MAGIC, the
header's length (8 bytes, little-endian), the header (JSON: the value's shape, with each array
replaced by a reference to a leaf, and each leaf's byte range), then each leaf as an Arrow IPC stream.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from collections.abc import Callable, Iterable

import numpy as np
import pyarrow as pa

from madp.core import storage
from madp.core.batch_files import FileRows
from madp.core.records import RecordChunk, Rejects

MAGIC = b"MADPSTR1"
Slice = tuple[str, int, int]  # a slice of a store file, the handle a bulk exchange sends: (path, offset, length)
# The dataclasses a store file may hold, by name; decoding builds no other class.
DATACLASSES = {cls.__name__: cls for cls in (RecordChunk, Rejects, FileRows)}


class PartitionStore:
    """Named files of arrays in one directory; a file's name is unique to what wrote it (pipeline
    run, partition, step), so a retried bundle rewrites identical content."""

    def __init__(self, directory: str):
        self.directory = directory

    def write_arrays(self, name: str, arrays: object) -> str:
        path = storage.join(self.directory, name)
        with storage.open_output(path) as handle:
            handle.write(encode(arrays))
        return path

    @staticmethod
    def read_arrays(path: str):
        with storage.open_input(path) as handle:
            return decode(handle.read(), path)

    def write_slices(self, name: str, slices: dict[int, object]) -> dict[int, Slice]:
        """One file per sender for a bulk exchange; each receiver gets (path, offset, length) of its slice."""
        blobs = {destination: encode(payload) for destination, payload in slices.items()}
        path, offset, where = storage.join(self.directory, name), 0, {}
        with storage.open_output(path) as handle:
            for destination, blob in blobs.items():
                handle.write(blob)
                where[destination] = (path, offset, len(blob))
                offset += len(blob)
        return where

    @staticmethod
    def read_slice(where: Slice):
        path, offset, length = where
        with storage.open_input(path) as handle:
            return decode(handle.read_at(length, offset), f"{path} at {offset}")

    def write_split(
        self, name: str, destination: np.ndarray, payload: Callable[[np.ndarray], object]
    ) -> list[tuple[int, Slice]]:
        """Aligned arrays split by destination partition (`payload(mask)` of each) into one file;
        (destination, slice handle) pairs."""
        parts = {int(d): payload(destination == d) for d in np.unique(destination)}
        return list(self.write_slices(name, parts).items()) if parts else []

    def gather(self, handles: Iterable[Slice]) -> list:
        """The slices sent to a partition, in a fixed order whatever order the runner delivers them in."""
        return [self.read_slice(h) for h in sorted(handles)]


@functools.lru_cache(maxsize=8)
def read_static(path: str) -> dict:
    """Arrays written once and never changed: each worker reads a file's once, read-only."""
    arrays = PartitionStore.read_arrays(path)
    for array in arrays.values():
        array.flags.writeable = False
    return arrays


def stack(pieces: list[tuple], field: int) -> np.ndarray:
    """One array from field `field` of every gathered slice."""
    return np.concatenate([piece[field] for piece in pieces])


# --- the file format ------------------------------------------------------------------------------


def encode(value: object) -> bytes:
    """`value` as one store blob (see the module's description)."""
    leaves: list[pa.Table] = []
    shape = _skeleton(value, leaves)
    streams = []
    for table in leaves:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        streams.append(sink.getvalue())
    ranges, offset = [], 0
    for stream in streams:
        ranges.append([offset, stream.size])
        offset += stream.size
    header = json.dumps({"value": shape, "leaves": ranges}, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(header)), header, *streams])


def decode(blob: bytes, where: str):
    """The value `encode` wrote; a blob it did not write is a ValueError naming `where`."""
    if blob[: len(MAGIC)] != MAGIC:
        raise ValueError(f"{where}: not a madp partition store file (was it written by another program?)")
    (length,) = struct.unpack_from("<Q", blob, len(MAGIC))
    start = len(MAGIC) + 8
    header = json.loads(blob[start : start + length])
    body = memoryview(blob)[start + length :]
    leaves = [pa.ipc.open_stream(pa.py_buffer(body[a : a + n])).read_all() for a, n in header["leaves"]]
    return _build(header["value"], leaves, where)


def _leaf(table: pa.Table, leaves: list[pa.Table]) -> int:
    leaves.append(table)
    return len(leaves) - 1


def _skeleton(value, leaves: list[pa.Table]):
    """JSON for `value`, each array put in `leaves`; tagged objects say what each non-JSON value was."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError("the partition store holds numeric, boolean and string arrays, not object arrays")
        column = pa.array(np.ascontiguousarray(value).reshape(-1))
        return {"ndarray": _leaf(pa.table({"v": column}), leaves), "dtype": value.dtype.str, "shape": value.shape}
    if isinstance(value, np.generic):
        return {"scalar": value.item(), "dtype": value.dtype.str}
    if isinstance(value, pa.ChunkedArray):
        return {"arrow_array": _leaf(pa.table({"v": value.combine_chunks()}), leaves)}
    if isinstance(value, pa.Array):
        return {"arrow_array": _leaf(pa.table({"v": value}), leaves)}
    if isinstance(value, pa.Table):
        return {"arrow_table": _leaf(value, leaves)}
    if isinstance(value, pa.DataType):
        return {"arrow_type": _leaf(pa.table({"v": pa.array([], value)}), leaves)}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [_skeleton(v, leaves) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_skeleton(k, leaves), _skeleton(v, leaves)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and DATACLASSES.get(type(value).__name__) is type(value):
        fields = {f.name: _skeleton(getattr(value, f.name), leaves) for f in dataclasses.fields(value)}
        return {"dataclass": type(value).__name__, "fields": fields}
    raise TypeError(f"the partition store cannot hold a {type(value).__name__}")


def _build(shape, leaves: list[pa.Table], where: str):
    if not isinstance(shape, dict):
        return shape
    if "ndarray" in shape:
        values = leaves[shape["ndarray"]].column(0).to_numpy()
        return np.array(values, dtype=np.dtype(shape["dtype"])).reshape(shape["shape"])  # a writable copy
    if "scalar" in shape:
        return np.dtype(shape["dtype"]).type(shape["scalar"])
    if "arrow_array" in shape:
        return leaves[shape["arrow_array"]].column(0).combine_chunks()
    if "arrow_table" in shape:
        return leaves[shape["arrow_table"]]  # IPC keeps a table's rows even with no columns
    if "arrow_type" in shape:
        return leaves[shape["arrow_type"]].schema.field(0).type
    if "list" in shape:
        return [_build(v, leaves, where) for v in shape["list"]]
    if "tuple" in shape:
        return tuple(_build(v, leaves, where) for v in shape["tuple"])
    if "dict" in shape:
        return {_build(k, leaves, where): _build(v, leaves, where) for k, v in shape["dict"]}
    if shape.get("dataclass") in DATACLASSES:
        fields = {name: _build(v, leaves, where) for name, v in shape["fields"].items()}
        return DATACLASSES[shape["dataclass"]](**fields)
    raise ValueError(f"{where}: not a madp partition store file (unknown entry {sorted(shape)})")
