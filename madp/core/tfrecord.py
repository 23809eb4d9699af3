"""Columnar writer of `tf.train.Example` rows in TFRecord files, without TensorFlow, and the check that
a file is whole TFRecords before TensorFlow reads it.

Rows are encoded column by column as *ragged byte arrays* (a flat uint8 buffer plus one length
per row), so a million rows cost a few numpy passes instead of a million Python calls. Wire
format: protobuf encoding of tensorflow/core/example/{example,feature}.proto; TFRecord framing
is uint64 length, masked crc32c of the length, data, masked crc32c of the data.
"""

from __future__ import annotations

import dataclasses

import google_crc32c
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from madp.core import storage
from madp.core.errors import InputError

INT64, FLOAT, BYTES = "int64", "float", "bytes"
_LIST_FIELD = {BYTES: 1, FLOAT: 2, INT64: 3}  # Feature.kind oneof field numbers


@dataclasses.dataclass(frozen=True)
class Ragged:
    data: np.ndarray  # uint8
    lengths: np.ndarray  # int64, one per row

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)


def _constant(value: bytes, rows: int) -> Ragged:
    return Ragged(np.tile(np.frombuffer(value, np.uint8), rows), np.full(rows, len(value), np.int64))


def _varints(values: np.ndarray) -> Ragged:
    """Base-128 varint of each uint64 value (negative int64 as two's complement: 10 bytes)."""
    values = values.astype(np.int64).view(np.uint64)
    lengths = np.ones(len(values), dtype=np.int64)
    for bits in range(7, 64, 7):  # one more byte for each 7 bits beyond the first 7
        lengths += values >= (np.uint64(1) << np.uint64(bits))
    if len(values) and lengths.max() == 1:
        return Ragged(values.astype(np.uint8), lengths)
    width = int(lengths.max()) if len(values) else 1
    shifts = np.arange(width, dtype=np.uint64) * np.uint64(7)
    groups = ((values[:, None] >> shifts[None, :]) & np.uint64(0x7F)).astype(np.uint8)
    more = (np.arange(width)[None, :] < (lengths[:, None] - 1)).astype(np.uint8) << 7
    return Ragged((groups | more)[np.arange(width)[None, :] < lengths[:, None]], lengths)


def _concat(parts: list[Ragged]) -> Ragged:
    """Row i of the result is row i of each part, in order."""
    lengths = np.sum([p.lengths for p in parts], axis=0).astype(np.int64)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    row_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    before = np.zeros(len(lengths), dtype=np.int64)
    for part in parts:
        position = np.repeat(row_start + before - part.offsets[:-1], part.lengths) + np.arange(len(part.data))
        out[position] = part.data
        before += part.lengths
    return Ragged(out, lengths)


def _group(values: Ragged, rows_of_values: np.ndarray, rows: int) -> Ragged:
    """Concatenate consecutive value encodings into one per row (`rows_of_values` non-decreasing)."""
    return Ragged(values.data, np.bincount(rows_of_values, weights=values.lengths, minlength=rows).astype(np.int64))


def _delimited(field: int, payload: Ragged) -> Ragged:
    """A length-delimited protobuf field: tag, varint length, payload."""
    rows = len(payload.lengths)
    return _concat([_constant(bytes([field << 3 | 2]), rows), _varints(payload.lengths), payload])


def _flat_values(column: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(flat values, row of each value) of a scalar or list column."""
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        return pc.list_flatten(column), pc.list_parent_indices(column).to_numpy().astype(np.int64)
    return column, np.arange(len(column), dtype=np.int64)


def feature_kind(value_type: pa.DataType) -> str:
    if pa.types.is_integer(value_type) or pa.types.is_boolean(value_type):
        return INT64
    if pa.types.is_floating(value_type):
        return FLOAT
    if (
        pa.types.is_string(value_type)
        or pa.types.is_large_string(value_type)
        or pa.types.is_binary(value_type)
        or pa.types.is_large_binary(value_type)
    ):
        return BYTES
    raise ValueError(f"type {value_type} has no tf.train.Feature kind")


def _values_payload(column: pa.Array) -> tuple[str, Ragged]:
    """The feature kind of a column and, per row, its values: packed numbers (the payload of field 1
    of Int64List/FloatList), or the repeated field 1 entries of BytesList."""
    rows = len(column)
    values, row_of_value = _flat_values(column)
    kind = feature_kind(values.type)
    if kind == INT64:
        return kind, _group(_varints(values.cast(pa.int64()).to_numpy(zero_copy_only=False)), row_of_value, rows)
    if kind == FLOAT:
        raw = values.cast(pa.float32()).to_numpy(zero_copy_only=False).astype("<f4").view(np.uint8)
        return kind, Ragged(raw, 4 * np.bincount(row_of_value, minlength=rows).astype(np.int64))
    binary = values.cast(pa.large_binary())
    offsets = np.frombuffer(binary.buffers()[1], np.int64)[binary.offset : binary.offset + len(binary) + 1]
    buffer = binary.buffers()[2]
    flat = np.frombuffer(buffer, np.uint8)[offsets[0] : offsets[-1]] if buffer is not None else np.zeros(0, np.uint8)
    return kind, _group(_delimited(1, Ragged(flat.copy(), np.diff(offsets))), row_of_value, rows)


def _varint_size(lengths: np.ndarray) -> np.ndarray:
    size = np.ones(len(lengths), dtype=np.int64)
    for bits in range(7, 64, 7):
        size += lengths >= (1 << bits)
    return size


def serialize_examples(columns: dict[str, pa.Array]) -> Ragged:
    """One serialized tf.train.Example per row; features in the order given.

    Nesting (Example > Features > map entry > Feature > value list) is laid out in one pass: the
    lengths of every level are computed first, then all pieces are copied once into place.
    """
    rows = len(next(iter(columns.values())))
    segments, features_length = [], np.zeros(rows, dtype=np.int64)
    for name, column in columns.items():
        kind, payload = _values_payload(column)
        # Numbers are packed into one field (tag, length, values); strings are already repeated fields.
        packed = kind != BYTES
        list_length = payload.lengths + (1 + _varint_size(payload.lengths) if packed else 0)
        feature_length = 1 + _varint_size(list_length) + list_length  # kind tag, length, list
        key = bytes([0x0A]) + bytes(_varints(np.array([len(name.encode())])).data) + name.encode()
        entry_length = len(key) + 1 + _varint_size(feature_length) + feature_length  # key, value tag, length, Feature
        features_length += 1 + _varint_size(entry_length) + entry_length
        segments += [
            _constant(b"\x0a", rows),
            _varints(entry_length),
            _constant(key + b"\x12", rows),
            _varints(feature_length),
            _constant(bytes([_LIST_FIELD[kind] << 3 | 2]), rows),
            _varints(list_length),
        ]
        segments += [_constant(b"\x0a", rows), _varints(payload.lengths), payload] if packed else [payload]
    return _concat([_constant(b"\x0a", rows), _varints(features_length), *segments])


def _masked(crc):
    """TFRecord's masked CRC-32C of a CRC-32C: of a Python int, or of each of a uint64 array (32-bit values)."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord_bytes(examples: Ragged) -> bytes:
    """TFRecord framing of each serialized example, concatenated."""
    offsets, rows = examples.offsets, len(examples.lengths)
    data = examples.data.tobytes()
    header = examples.lengths.astype("<u8")
    # The header checksum depends on the length only: one crc per distinct length.
    distinct, index = np.unique(header, return_inverse=True)
    length_crc = _masked(np.array([google_crc32c.value(v.tobytes()) for v in distinct], dtype=np.uint64))[index]
    data_crc = _masked(
        np.array([google_crc32c.value(data[offsets[i] : offsets[i + 1]]) for i in range(rows)], dtype=np.uint64)
    )
    framed = _concat(
        [
            Ragged(header.view(np.uint8), np.full(rows, 8, np.int64)),
            Ragged(length_crc.astype("<u4").view(np.uint8), np.full(rows, 4, np.int64)),
            examples,
            Ragged(data_crc.astype("<u4").view(np.uint8), np.full(rows, 4, np.int64)),
        ]
    )
    return framed.data.tobytes()


def check_records(path: str) -> None:
    """Refuse a TFRecord file that TensorFlow's reader would stop in with a DataLossError halfway through
    a training: a record cut short (a truncated file), or a length or data that fails its checksum. An
    InputError names the file and the byte where its record starts. Read in 1 MiB blocks: memory holds
    a record and a block."""
    pending = bytearray()
    start = 0  # the byte of the file where `pending` starts
    with storage.open_input(path) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            pending += block
            position = 0
            while len(pending) - position >= 12:
                header = bytes(pending[position : position + 8])
                if int.from_bytes(pending[position + 8 : position + 12], "little") != _masked_crc(header):
                    raise _damaged(path, start + position, "its length fails its checksum")
                end = position + 16 + int.from_bytes(header, "little")
                if end > len(pending):
                    break
                if int.from_bytes(pending[end - 4 : end], "little") != _masked_crc(
                    bytes(pending[position + 12 : end - 4])
                ):
                    raise _damaged(path, start + position, "its data fails its checksum")
                position = end
            del pending[:position]
            start += position
    if pending:
        raise _damaged(path, start, f"the file ends {len(pending)} bytes into it: cut short")


def _masked_crc(data: bytes) -> int:
    return _masked(google_crc32c.value(data))


def _damaged(path: str, at: int, why: str) -> InputError:
    return InputError(
        f"{path}: the record at byte {at} is damaged ({why}): not the file madp batch wrote; re-run madp batch"
    )
