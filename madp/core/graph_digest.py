"""An order-independent digest of the user-record graph: which record ids exist and which users each
has, not what the records hold.

`madp bound` writes the digest of the graph it bounded (its valid records, after rejected rows and
duplicated ids, each record's users without repeats) into its report; `madp batch` recomputes it
over DATA and refuses DATA whose graph differs, since the contribution bound holds for the bounded
graph only. It is an integrity check against using other data (or other id and users columns) by
mistake, not a cryptographic commitment: string ids pass through an unkeyed 64-bit hash, and
whoever can write an OUTPUT directory can rewrite its report anyway (docs/privacy.md, Security). `madp
verify-batches` re-derives the bound from the records and the batches without it.

Each record contributes, in each of two independent lanes, the element hash
`splitmix64(splitmix64(id word ^ c_id) + splitmix64(sum over its users of splitmix64(user word ^ c_user)))`
(modulo 2^64): a function of the id and of the *set* of its users. The lanes are the sums of the
element hashes modulo 2^64, so the digest does not depend on the order of records or users, and the
digests of disjoint parts of the graph add up to the digest of the whole, whatever the sharding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from madp.core.hashing import id_words, splitmix64

SCHEME = "madp-graph-digest-v1"  # changes with the definition above: an older digest is not comparable
_MASK = (1 << 64) - 1
# Per lane: (constant of record ids, constant of user ids).
_LANES = ((0x243F6A8885A308D3, 0x13198A2E03707344), (0xA4093822299F31D0, 0x082EFA98EC4E6C89))
# Mixed into the constants by the ids' type, so that integer id 7 and string id "7" differ.
_INTEGER_TAG, _STRING_TAG = 0x452821E638D01377, 0xBE5466CF34E90C6C
_HALF = 32  # lanes travel as 32-bit halves where partial digests are summed as plain integers
_BLOCK_RECORDS = 1 << 16  # records digested at a time


@dataclasses.dataclass(frozen=True)
class GraphDigest:
    """Two 64-bit lanes, the records and the (record, user) incidences of a graph or part of one."""

    lanes: tuple[int, int]
    records: int
    incidences: int

    def __add__(self, other: GraphDigest) -> GraphDigest:
        """The digest of two disjoint parts together."""
        lanes = tuple((a + b) & _MASK for a, b in zip(self.lanes, other.lanes))
        return GraphDigest((lanes[0], lanes[1]), self.records + other.records, self.incidences + other.incidences)

    @property
    def hex(self) -> str:
        return "".join(f"{lane:016x}" for lane in self.lanes)

    def to_report(self) -> dict:
        """The report's `graph_digest`."""
        return {"scheme": SCHEME, "digest": self.hex, "records": self.records, "incidences": self.incidences}

    @classmethod
    def from_json(cls, value: object) -> GraphDigest:
        """A report's `graph_digest`; ValueError when it is not one of this scheme."""
        if not isinstance(value, dict) or value.get("scheme") != SCHEME:
            raise ValueError(f"not a graph digest of scheme {SCHEME}")
        digest, records, incidences = value.get("digest"), value.get("records"), value.get("incidences")
        if not (isinstance(records, int) and isinstance(incidences, int)):
            raise ValueError("a graph digest needs integer counts of records and incidences")
        if not (isinstance(digest, str) and len(digest) == 32):
            raise ValueError("a graph digest needs a 32-digit hex digest")
        try:
            return cls((int(digest[:16], 16), int(digest[16:], 16)), records, incidences)
        except ValueError as error:
            raise ValueError(f"graph digest {digest!r} is not hexadecimal") from error

    def to_counts(self, prefix: str = "graph_digest_") -> dict[str, int]:
        """As named counts below 2^32 (lanes split into halves) whose sums over parts give the whole
        (`from_counts`): for pipelines that gather their figures by summing 64-bit signed integers."""
        counts = {f"{prefix}records": self.records, f"{prefix}incidences": self.incidences}
        for index, lane in enumerate(self.lanes):
            counts[f"{prefix}lane{index}_low"] = lane & ((1 << _HALF) - 1)
            counts[f"{prefix}lane{index}_high"] = lane >> _HALF
        return counts

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], prefix: str = "graph_digest_") -> GraphDigest:
        """The digest of summed `to_counts` (absent names are zeros: no part)."""
        lanes = tuple(
            (counts.get(f"{prefix}lane{i}_low", 0) + (counts.get(f"{prefix}lane{i}_high", 0) << _HALF)) & _MASK
            for i in range(2)
        )
        return cls((lanes[0], lanes[1]), counts.get(f"{prefix}records", 0), counts.get(f"{prefix}incidences", 0))


EMPTY = GraphDigest((0, 0), 0, 0)


def _tag(values: pa.Array) -> int:
    return _INTEGER_TAG if pa.types.is_integer(values.type) else _STRING_TAG


def graph_digest(ids: pa.Array, offsets: np.ndarray, users: pa.Array) -> GraphDigest:
    """The digest of records `ids` whose users are `users[offsets[i]:offsets[i + 1]]` (CSR, no user
    twice in a record, as `records.RecordChunk` holds them): the sum of its blocks' digests, so that
    its temporaries are a block's, whatever the partition's size."""
    offsets = np.asarray(offsets, dtype=np.int64)
    digest = EMPTY
    for start in range(0, len(ids), _BLOCK_RECORDS):
        end = min(start + _BLOCK_RECORDS, len(ids))
        first, last = int(offsets[start]), int(offsets[end])
        digest += _block_digest(ids[start:end], offsets[start : end + 1] - first, users[first:last])
    return digest


def _block_digest(ids: pa.Array, offsets: np.ndarray, users: pa.Array) -> GraphDigest:
    """The digest of records `ids` with users `users[offsets[i]:offsets[i + 1]]`, offsets from 0."""
    record_words, user_words = id_words(ids), id_words(users) if len(users) else np.zeros(0, np.uint64)
    record_tag, user_tag = _tag(ids), _tag(users)
    lanes = []
    with np.errstate(over="ignore"):  # sums modulo 2^64 by definition
        for record_constant, user_constant in _LANES:
            user_hash = splitmix64(user_words ^ np.uint64(user_constant ^ user_tag))
            running = np.concatenate([np.zeros(1, np.uint64), np.cumsum(user_hash, dtype=np.uint64)])
            user_sets = running[offsets[1:]] - running[offsets[:-1]]  # per record, any arity (0 too)
            record_hash = splitmix64(record_words ^ np.uint64(record_constant ^ record_tag))
            element = splitmix64(record_hash + splitmix64(user_sets))
            lanes.append(int(np.sum(element, dtype=np.uint64)))
    return GraphDigest((lanes[0], lanes[1]), len(ids), int(offsets[-1]))
