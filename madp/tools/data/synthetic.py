"""Synthetic multi-user datasets of "It's my data too" (Ganesh et al.), App. C.1, with a
logistic-regression or (`task="text"`, `synthetic_text`) a topic-labelled text content.

Graphs: `regular` (each record's users uniform among m users) and `skewed` (users chosen with
probability proportional to (1 + degree)^alpha, a sequential preferential process). Content:
the logistic-regression task y ~ Bernoulli(sigmoid(k1 <2/(1+k) (a + k |e| b), z>)).

Records need at least one user, so arity is 1 + Poisson(mean_arity - 1) (mean `mean_arity`)
instead of the paper's Poisson(mean_arity).

A draw that would hold more than WHOLE_DRAW_BYTES is made and written part by part
(`write_generated`): each part a graph of its own records and users, from a stream of its own, so that
memory is that of one part at any size; smaller draws are made whole, the records a seed has always given.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from madp.core import storage
from madp.core.errors import InputError, check_memory, positive
from madp.tools.data.synthetic_text import documents

# The skewed process re-reads degrees after every STALENESS fraction of the records drawn so
# far: this turns the sequential process into O(1/STALENESS * log N) vectorized chunks.
STALENESS = 0.05
_FIRST_CHUNK = 1024
_REDRAWS = 8


# Peak bytes of `generate`, rounded up: an incidence's user id (int64) and the preferential process's
# copies of it; a feature's float64 draw, its float32 copy and the Arrow table's.
BYTES_PER_INCIDENCE, BYTES_PER_FEATURE = 64, 16
# The most a draw holds made whole (`generate`); a larger one is made in parts of about PART_BYTES each.
WHOLE_DRAW_BYTES = 8 << 30
PART_BYTES = 512 << 20
PARTS_STREAM = 4  # the random stream of a draw made in parts: [seed, PARTS_STREAM] its truth, then each part's


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    records: int
    graph: str = "skewed"  # "regular" or "skewed"
    mean_arity: float = 2.0  # E|e|, expected users per record
    records_per_user: float = 2.0  # d_u, expected records per user
    alpha: float = 1.5  # skew of the preferential process
    features: int = 16  # dimension of z
    steepness: float = 20.0  # k1 of the sigmoid
    bias_scale: float = 1.0  # k: weight of the arity-dependent bias vector b
    seed: int = 0
    task: str = "logistic"  # "logistic" (features, 0/1 label) or "text" (text, topic label)

    def __post_init__(self) -> None:
        if self.records < 1:
            raise InputError("--records must be at least 1")
        if self.task not in ("logistic", "text"):
            raise InputError("--task must be 'logistic' or 'text'")
        if self.graph not in ("regular", "skewed"):
            raise InputError("--graph must be 'regular' or 'skewed'")
        if not (self.mean_arity >= 1 and math.isfinite(self.mean_arity)):
            raise InputError("--mean-arity must be finite and at least 1 (every record has a user)")
        at_least_zero = all(math.isfinite(value) and value >= 0 for value in (self.alpha, self.bias_scale))
        if not positive(self.records_per_user) or self.features < 1 or not at_least_zero:
            raise InputError(
                "--records-per-user must be positive, --alpha and --bias-scale at least 0 (all finite), --features >= 1"
            )
        check_memory(
            self.peak_bytes if self.drawn_whole else self.part_records * self.bytes_per_record,
            f"--records {self.records} with --mean-arity {self.mean_arity:g} and --features {self.features} hold",
            "generate fewer records, users per record or features",
        )

    @property
    def peak_bytes(self) -> float:
        """About the most memory `generate` holds: BYTES_PER_INCIDENCE per record-user pair and
        BYTES_PER_FEATURE per record and feature (the logistic task's vectors and matrix)."""
        features = (self.records + 2) * self.features if self.task == "logistic" else 0
        return BYTES_PER_INCIDENCE * self.records * self.mean_arity + BYTES_PER_FEATURE * features

    @property
    def bytes_per_record(self) -> float:
        return BYTES_PER_INCIDENCE * self.mean_arity + (
            BYTES_PER_FEATURE * self.features if self.task == "logistic" else 0
        )

    @property
    def drawn_whole(self) -> bool:
        """Whether the records are drawn at once (`generate`), not part by part (`write_generated`)."""
        return self.peak_bytes <= WHOLE_DRAW_BYTES

    @property
    def part_records(self) -> int:
        """The records of each part of a draw made part by part (the last may hold fewer)."""
        return max(1, int(PART_BYTES // self.bytes_per_record))

    @property
    def users(self) -> int:
        return max(1, round(self.records * self.mean_arity / self.records_per_user))


@dataclasses.dataclass
class SyntheticData:
    offsets: np.ndarray  # int64, CSR offsets of each record's users
    users: np.ndarray  # int64 user ids
    features: np.ndarray | None  # float32 [records, features] (logistic task)
    labels: np.ndarray  # int64 0/1 (logistic task) or topic names (text task)
    texts: list[str] | None = None  # text task


def arities(rng: np.random.Generator, size: int, mean_arity: float) -> np.ndarray:
    return 1 + rng.poisson(mean_arity - 1.0, size=size)


def _regular_graph(spec: GraphSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Probabilistic regular graph: arity, then that many distinct users uniformly at random."""
    arity = np.minimum(arities(rng, spec.records, spec.mean_arity), spec.users)
    offsets = np.concatenate([[0], np.cumsum(arity)]).astype(np.int64)
    users = rng.integers(0, spec.users, size=offsets[-1])
    parents = np.repeat(np.arange(spec.records), arity)
    for _ in range(_REDRAWS):
        repeated = _repeated_within_record(parents, users)
        if not repeated.any():
            break
        users[repeated] = rng.integers(0, spec.users, size=int(repeated.sum()))
    return _drop_repeats(offsets, parents, users)


def _skewed_graph(spec: GraphSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Preferential process of App. C.1: P(user j) proportional to (1 + d_j)^alpha.

    Users not yet seen all have weight 1, so a draw either opens the next new user or picks a
    seen user by weight; degrees are refreshed every STALENESS fraction of records.
    """
    arity = np.minimum(arities(rng, spec.records, spec.mean_arity), spec.users)
    offsets = np.concatenate([[0], np.cumsum(arity)]).astype(np.int64)
    users = np.empty(offsets[-1], dtype=np.int64)
    degree = np.zeros(spec.users, dtype=np.int64)
    seen = 0
    start = 0
    while start < spec.records:
        stop = min(spec.records, start + max(_FIRST_CHUNK, int(start * STALENESS)))
        lo, hi = offsets[start], offsets[stop]
        parents = np.repeat(np.arange(start, stop), arity[start:stop])
        cumulative = np.cumsum((1.0 + degree[:seen]) ** spec.alpha)  # weights of users seen before the chunk
        seen_weight = float(cumulative[-1]) if seen else 0.0
        unseen_weight = float(spec.users - seen)
        draws = np.empty(hi - lo, dtype=np.int64)
        pending = np.ones(hi - lo, dtype=bool)
        for _ in range(_REDRAWS):
            index = np.flatnonzero(pending)
            new = rng.random(len(index)) * (unseen_weight + seen_weight) < unseen_weight
            old = index[~new]
            draws[old] = (
                np.searchsorted(cumulative, rng.random(len(old)) * seen_weight, side="right")
                if seen_weight
                else rng.integers(0, max(seen, 1), size=len(old))
            )
            wanted = index[new]
            opened = min(len(wanted), spec.users - seen)
            draws[wanted[:opened]] = seen + np.arange(opened)
            seen += opened
            # Only in tiny graphs do draws ask for more new users than exist: take seen ones.
            draws[wanted[opened:]] = rng.integers(0, seen, size=len(wanted) - opened)
            unseen_weight = float(spec.users - seen)
            pending = _repeated_within_record(parents, draws)
            if not pending.any():
                break
        users[lo:hi] = draws
        np.add.at(degree, draws[~pending], 1)
        start = stop
    parents = np.repeat(np.arange(spec.records), arity)
    offsets, users = _drop_repeats(offsets, parents, users)
    # Activation order would make small user ids the popular ones; hide it.
    return offsets, rng.permutation(spec.users)[users]


def _repeated_within_record(parents: np.ndarray, users: np.ndarray) -> np.ndarray:
    order = np.lexsort((users, parents))
    same = (parents[order][1:] == parents[order][:-1]) & (users[order][1:] == users[order][:-1])
    repeated = np.zeros(len(users), dtype=bool)
    repeated[order[1:][same]] = True
    return repeated


def _drop_repeats(offsets: np.ndarray, parents: np.ndarray, users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = ~_repeated_within_record(parents, users)
    counts = np.bincount(parents[keep], minlength=len(offsets) - 1)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), users[keep]


def _truth(spec: GraphSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The logistic task's base vector a and arity-dependent bias vector b, each ~ N(0, I/d)."""
    scale = 1.0 / np.sqrt(spec.features)
    return rng.normal(0.0, scale, spec.features), rng.normal(0.0, scale, spec.features)


def _logistic_content(
    spec: GraphSpec, arity: np.ndarray, rng: np.random.Generator, truth: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Features z ~ N(0, I/d); label ~ Bernoulli(sigmoid(k1 <2/(1+k) (a + k|e| b), z>)), (a, b) the `truth`."""
    base, bias = truth
    z = rng.normal(0.0, 1.0 / np.sqrt(spec.features), (spec.records, spec.features))
    truth = (2.0 / (1.0 + spec.bias_scale)) * (base[None, :] + spec.bias_scale * arity[:, None] * bias[None, :])
    logits = spec.steepness * np.einsum("ij,ij->i", truth, z)
    labels = (rng.random(spec.records) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int64)
    return z.astype(np.float32), labels


def generate(spec: GraphSpec) -> SyntheticData:
    """The records of `spec`, drawn at once."""
    rng = np.random.default_rng(spec.seed)
    offsets, users = _graph(spec, rng)
    return _with_content(spec, offsets, users, rng, lambda: _truth(spec, rng), ())


def _graph(spec: GraphSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return (_regular_graph if spec.graph == "regular" else _skewed_graph)(spec, rng)


def _with_content(spec: GraphSpec, offsets, users, rng, truth, part: tuple[int, ...]) -> SyntheticData:
    """The records of a graph with their content: texts (their stream that of `part`), or features and labels
    (`truth()` gives the logistic task's vectors, drawn after the graph where a draw is made whole)."""
    if spec.task == "text":
        texts, topics = documents(offsets, users, spec.seed, part)
        return SyntheticData(offsets=offsets, users=users, features=None, labels=topics, texts=texts)
    features, labels = _logistic_content(spec, np.diff(offsets), rng, truth())
    return SyntheticData(offsets=offsets, users=users, features=features, labels=labels)


def _parts(spec: GraphSpec):
    """(first record id, the part's records) of each part of a draw made part by part: each a graph of
    `spec.part_records` records (the last one fewer) among users of its own, its user ids after those of
    the parts before; the logistic task's truth is the whole draw's, its own stream."""
    truth = _truth(spec, np.random.default_rng([spec.seed, PARTS_STREAM]))
    first_user = 0
    for index, first in enumerate(range(0, spec.records, spec.part_records)):
        part = dataclasses.replace(spec, records=min(spec.part_records, spec.records - first))
        rng = np.random.default_rng([spec.seed, PARTS_STREAM, index])
        offsets, users = _graph(part, rng)
        users += first_user
        first_user += part.users
        yield first, _with_content(part, offsets, users, rng, lambda: truth, (PARTS_STREAM, index))


USERS_AS = ("users", "from-to-cc", "both")  # `madp generate --users-as`: how the users are written
SENDER_IN_CC_EVERY = 8  # records with id % 8 == 3 also list their sender in cc, as senders copying themselves do


def to_table(data: SyntheticData, users_as: str = "users", first_id: int = 0) -> pa.Table:
    """Records as rows: integer id (from `first_id` on), users, and the content (features or text, and
    the label). The users are a `users` list, or (`users_as`) as an email export holds them: `from` (the
    first user), `to` and `cc` (lists; cc null where empty), whose union is the same users
    (`--users-columns from,to,cc`), or both."""
    if users_as not in USERS_AS:
        raise InputError(f"--users-as must be one of {', '.join(USERS_AS)}")
    ids = np.arange(first_id, first_id + len(data.labels), dtype=np.int64)
    records = {"id": pa.array(ids)}
    if users_as != "from-to-cc":
        records["users"] = pa.ListArray.from_arrays(pa.array(data.offsets, pa.int32()), pa.array(data.users))
    if users_as != "users":
        records.update(_email_columns(data.offsets, data.users, ids))
    if data.features is None:
        return pa.table({**records, "text": pa.array(data.texts, pa.string()), "label": pa.array(data.labels.tolist())})
    features = pa.FixedSizeListArray.from_arrays(pa.array(data.features.ravel()), data.features.shape[1])
    return pa.table({**records, "features": features, "label": pa.array(data.labels)})


def _email_columns(offsets: np.ndarray, users: np.ndarray, ids: np.ndarray) -> dict[str, pa.Array]:
    """`from`, `to` and `cc` of records whose users are users[offsets[i]:offsets[i + 1]]: the first user
    sends, the first half of the others (rounded up) are in to, the rest in cc; a record with id % 8 == 3
    also has its sender in cc (a repeat the union counts once)."""
    records = len(offsets) - 1
    arity = np.diff(offsets)
    record_of = np.repeat(np.arange(records), arity)
    position = np.arange(len(users)) - offsets[:-1][record_of]
    to_length = arity // 2  # of the arity - 1 others, the first half rounded up
    in_to = (position >= 1) & (position <= to_length[record_of])
    in_cc = position > to_length[record_of]
    echo = np.flatnonzero(ids % SENDER_IN_CC_EVERY == 3)
    cc_record = np.concatenate([record_of[in_cc], echo])
    cc_users = np.concatenate([users[in_cc], users[offsets[:-1][echo]]])
    order = np.argsort(cc_record, kind="stable")  # each record's cc in order, the echoed sender last
    cc_length = np.bincount(cc_record, minlength=records)
    return {
        "from": pa.array(users[offsets[:-1]]),
        "to": _lists(to_length, users[in_to]),
        "cc": _lists(cc_length, cc_users[order], null_where_empty=True),
    }


def _lists(lengths: np.ndarray, values: np.ndarray, null_where_empty: bool = False) -> pa.Array:
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    mask = pa.array(lengths == 0) if null_where_empty else None
    return pa.ListArray.from_arrays(offsets, pa.array(values, pa.int64()), mask=mask)


def _write_table(table: pa.Table, output: str) -> None:
    """One .jsonl or .parquet file, whole or not at all (`storage.write_whole`): a full disk or a Ctrl-C
    leaves no truncated file for `madp bound` to read as the dataset."""
    if output.endswith(".jsonl"):
        storage.write_whole(output, lambda handle: _write_jsonl(handle, table))
    else:
        storage.write_parquet(table, output)


def _write_jsonl(handle, table: pa.Table) -> None:
    for batch in table.to_batches(max_chunksize=1 << 16):
        handle.write("".join(json.dumps(row) + "\n" for row in batch.to_pylist()).encode("utf-8"))


def _is_shard(relative: str) -> bool:
    """A name `write_dataset` gives a Parquet shard of a directory OUTPUT."""
    return re.fullmatch(r"part-\d+-of-\d+\.parquet", relative) is not None


def write_generated(
    spec: GraphSpec,
    output: str,
    shards: int,
    holdout: str | None = None,
    holdout_fraction: float = 0.1,
    users_as: str = "users",
) -> dict:
    """`madp generate`: the records of `spec` written as `write_dataset` writes them, drawn whole
    (`spec.drawn_whole`) or part by part (`_parts`), one part in memory at a time: a file's records are
    appended a part at a time, a directory's shards hold the drawn records' ids in equal ranges (less
    those held out)."""
    if spec.drawn_whole:
        return write_dataset(generate(spec), spec, output, shards, holdout, holdout_fraction, users_as)
    directory, earlier = _destination(spec, output, shards, holdout, holdout_fraction)
    drawn = _Drawn(spec, users_as, holdout_fraction if holdout is not None else None)
    written: list[str] = []

    def write_outputs(hold: Callable[[pa.Table], None] | None) -> None:
        drawn.hold = hold
        if not directory:
            _appending(output, functools.partial(drawn.take, spec.records))
            return
        bounds = np.linspace(0, spec.records, shards + 1).astype(int)
        for shard, path in enumerate(_shard_paths(output, shards)):
            _appending(path, functools.partial(drawn.take, int(bounds[shard + 1])))
            written.append(path)

    if holdout is None:
        write_outputs(None)
    else:
        _appending(holdout, write_outputs)
    if directory:
        storage.remove_written(output, [path for path in earlier if path not in written])
    return drawn.tally.summary(output, spec, drawn.kept, drawn.held)


class _Drawn:
    """The records of a draw made part by part, in id order, a part in memory at a time: each part's held-out
    records (the same stream as a whole draw's) given to `hold`, the kept ones taken a range of ids at a
    time (`take`)."""

    def __init__(self, spec: GraphSpec, users_as: str, holdout_fraction: float | None):
        self.parts, self.users_as, self.holdout_fraction = _parts(spec), users_as, holdout_fraction
        self.choose = np.random.default_rng([spec.seed, 1])
        self.hold: Callable[[pa.Table], None] | None = None
        self.pending: pa.Table | None = None  # kept records drawn and not yet taken
        self.drawn = self.kept = self.held = 0
        self.tally = _Tally()

    def take(self, stop: int, append: Callable[[pa.Table], None]) -> None:
        """Give `append` the kept records of ids below `stop` not yet taken (at least one table, maybe empty)."""
        while True:
            if self.pending is None or (len(self.pending) == 0 and self.drawn < stop):
                self.pending = self._next_part()
            below = int(np.searchsorted(self.pending.column("id").to_numpy(), stop))
            append(self.pending.slice(0, below))
            self.pending = self.pending.slice(below)
            if len(self.pending) or self.drawn >= stop:
                return

    def _next_part(self) -> pa.Table:
        first, data = next(self.parts)
        self.tally.add(data)
        table = to_table(data, self.users_as, first)
        self.drawn = first + len(table)
        if self.holdout_fraction is not None and self.hold is not None:
            chosen = self.choose.random(len(table)) < self.holdout_fraction
            self.hold(table.filter(pa.array(chosen)))
            table = table.filter(pa.array(~chosen))
            self.held += int(chosen.sum())
        self.kept += len(table)
        return table


def _appending(path: str, write_all: Callable[[Callable[[pa.Table], None]], object]) -> None:
    """A .jsonl or .parquet file written whole (`storage.write_whole`) from the tables `write_all` gives the
    function it is passed, in order."""

    def write(handle) -> None:
        parquet: pq.ParquetWriter | None = None

        def append(table: pa.Table) -> None:
            nonlocal parquet
            if path.endswith(".jsonl"):
                _write_jsonl(handle, table)
                return
            parquet = parquet or pq.ParquetWriter(handle, table.schema, write_page_checksum=True)
            parquet.write_table(table)

        write_all(append)
        if parquet is not None:
            parquet.close()

    storage.write_whole(path, write)


@dataclasses.dataclass
class _Tally:
    """What `madp generate` reports of the records drawn, added up a part at a time (the parts' users are
    their own, so the users of each degree add up)."""

    incidences: int = 0
    users_of_degree: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    label_counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    text: bool = False

    def add(self, data: SyntheticData) -> None:
        self.incidences += len(data.users)
        found = np.bincount(np.bincount(data.users))
        size = max(len(found), len(self.users_of_degree))
        self.users_of_degree = np.pad(self.users_of_degree, (0, size - len(self.users_of_degree)))
        self.users_of_degree[: len(found)] += found
        self.label_counts.update(data.labels.tolist())
        self.text = data.texts is not None

    def summary(self, output: str, spec: GraphSpec, records: int, held_out: int) -> dict:
        degrees = self.users_of_degree[1:]  # users of degree 1, 2, ...: those with no record left out
        users = int(degrees.sum())
        below = np.cumsum(degrees)
        middle = np.searchsorted(below, [(users - 1) // 2, users // 2], side="right") + 1
        labels = sum(self.label_counts.values())
        return {
            "output": output,
            "records": records,
            "held_out_records": held_out,
            "incidences": self.incidences,
            "users": users,
            "mean_users_per_record": round(self.incidences / max(records, 1), 4),
            "max_records_per_user": int(np.flatnonzero(degrees)[-1]) + 1 if users else 0,
            "median_records_per_user": float(middle.mean()) if users else math.nan,
            **(
                {"labels": {str(k): v for k, v in sorted(self.label_counts.items())}}
                if self.text
                else {"positive_labels": round(self.label_counts[1] / labels, 4)}
            ),
            "graph": spec.graph,
            "seed": spec.seed,
        }


def _destination(
    spec: GraphSpec, output: str, shards: int, holdout: str | None, holdout_fraction: float
) -> tuple[bool, list[str]]:
    """(whether `output` is a directory, the shards an earlier run wrote there), refusing, before anything
    is written, a --shards the records cannot fill, a file there that madp did not write, and a bad holdout."""
    directory = not output.endswith((".jsonl", ".parquet"))
    if directory and not 1 <= shards <= spec.records:
        raise InputError(f"--shards must be between 1 and --records ({spec.records}): more would write empty files")
    earlier = storage.written_files(output, _is_shard, "madp generate") if directory else []
    if holdout is not None and (not 0 < holdout_fraction < 1 or not holdout.endswith((".jsonl", ".parquet"))):
        raise InputError("--holdout must be a .jsonl or .parquet file and --holdout-fraction in (0, 1)")
    if directory:
        os.makedirs(output, exist_ok=True)
    return directory, earlier


def _shard_paths(output: str, shards: int) -> list[str]:
    return [
        os.path.join(os.path.abspath(output), f"part-{shard:05d}-of-{shards:05d}.parquet") for shard in range(shards)
    ]


def write_dataset(
    data: SyntheticData,
    spec: GraphSpec,
    output: str,
    shards: int,
    holdout: str | None = None,
    holdout_fraction: float = 0.1,
    users_as: str = "users",
) -> dict:
    """Write to one .jsonl/.parquet file, or to `shards` Parquet files in a directory; with
    `holdout`, a seeded random `holdout_fraction` of the records goes to that file instead. `users_as`:
    see `to_table`. A directory's shards of an earlier run are replaced: the new ones are written, then
    those they did not overwrite (another --shards) removed; a file there that madp did not write is
    refused by name before anything is written (a reader of the directory would take it for records)."""
    directory, earlier = _destination(spec, output, shards, holdout, holdout_fraction)
    table = to_table(data, users_as)
    held_out = 0
    if holdout is not None:
        chosen = np.random.default_rng([spec.seed, 1]).random(len(table)) < holdout_fraction
        _write_table(table.filter(pa.array(chosen)), holdout)
        table, held_out = table.filter(pa.array(~chosen)), int(chosen.sum())
    if not directory:
        _write_table(table, output)
    else:
        bounds = np.linspace(0, len(table), shards + 1).astype(int)
        written = _shard_paths(output, shards)
        for shard, path in enumerate(written):
            storage.write_parquet(table.slice(bounds[shard], bounds[shard + 1] - bounds[shard]), path)
        storage.remove_written(output, [path for path in earlier if path not in written])
    tally = _Tally()
    tally.add(data)
    return tally.summary(output, spec, len(table), held_out)
