"""TFRecord files, each record's checksums checked, and their tf.train.Example rows, read with the protobuf
runtime alone (no TensorFlow)."""

from __future__ import annotations

import struct
from collections.abc import Sequence


def _example_class():
    """tf.train.Example built from its .proto description with the protobuf runtime: no TensorFlow."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="madp_verify_example.proto", package="madp_verify")
    label = descriptor_pb2.FieldDescriptorProto
    for name, kind in (
        ("BytesList", label.TYPE_BYTES),
        ("FloatList", label.TYPE_FLOAT),
        ("Int64List", label.TYPE_INT64),
    ):
        message = proto.message_type.add(name=name)
        message.field.add(name="value", number=1, type=kind, label=label.LABEL_REPEATED)
    feature = proto.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, name in ((1, "bytes_list"), (2, "float_list"), (3, "int64_list")):
        type_name = {"bytes_list": "BytesList", "float_list": "FloatList", "int64_list": "Int64List"}[name]
        feature.field.add(
            name=name,
            number=number,
            type=label.TYPE_MESSAGE,
            label=label.LABEL_OPTIONAL,
            type_name=f".madp_verify.{type_name}",
            oneof_index=0,
        )
    features = proto.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=label.TYPE_STRING, label=label.LABEL_OPTIONAL)
    entry.field.add(
        name="value", number=2, type=label.TYPE_MESSAGE, label=label.LABEL_OPTIONAL, type_name=".madp_verify.Feature"
    )
    features.field.add(
        name="feature",
        number=1,
        type=label.TYPE_MESSAGE,
        label=label.LABEL_REPEATED,
        type_name=".madp_verify.Features.FeatureEntry",
    )
    example = proto.message_type.add(name="Example")
    example.field.add(
        name="features",
        number=1,
        type=label.TYPE_MESSAGE,
        label=label.LABEL_OPTIONAL,
        type_name=".madp_verify.Features",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("madp_verify.Example"))


def _masked_crc(data: bytes) -> int:
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_tfrecord(path: str):
    """Each record of a TFRecord file, checking both checksums; read in 1 MiB blocks, so memory holds a
    record and a block. A file cut short (in a record's header, data or checksum) is a ValueError."""
    pending = bytearray()
    start = 0  # the byte of the file where `pending` starts
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            pending += block
            position = 0
            while len(pending) - position >= 12:
                header = bytes(pending[position : position + 8])
                (length,) = struct.unpack("<Q", header)
                (length_crc,) = struct.unpack("<I", pending[position + 8 : position + 12])
                if length_crc != _masked_crc(header):
                    raise ValueError(f"{path}: corrupt record header at byte {start + position}")
                end = position + 16 + length
                if end > len(pending):
                    break
                payload = bytes(pending[position + 12 : end - 4])
                (payload_crc,) = struct.unpack("<I", pending[end - 4 : end])
                if payload_crc != _masked_crc(payload):
                    raise ValueError(f"{path}: corrupt record payload at byte {start + position}")
                yield payload
                position = end
            del pending[:position]
            start += position
    if pending:
        raise ValueError(f"{path}: cut short in the record at byte {start} (only {len(pending)} bytes of it)")


def _feature_values(example, name: str) -> list:
    return list(_kind_and_values(example.features.feature[name])[1])


def _kind_and_values(feature) -> tuple[str | None, Sequence]:
    """A feature's kind and its values (protobuf's own sequence: not copied)."""
    kind = feature.WhichOneof("kind")
    return kind, getattr(feature, kind).value if kind else ()
