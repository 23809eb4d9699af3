"""Synthetic multi-user datasets of "It's my data too" (Ganesh et al.), App. C.1, with a
logistic-regression or (`task="text"`, `synthetic_text`) a topic-labelled text content.

Graphs: `regular` (each record's users uniform among m users) and `skewed` (users chosen with
probability proportional to (1 + degree)^alpha, a sequential preferential process). Content:
the logistic-regression task y ~ Bernoulli(sigmoid(k1 <2/(1+k) (a + k |e| b), z>)).

Records need at least one user, so arity is 1 + Poisson(mean_arity - 1) (mean `mean_arity`)
instead of the paper's Poisson(mean_arity).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np
import pyarrow as pa

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
            self.peak_bytes,
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


def _logistic_content(spec: GraphSpec, arity: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Features z ~ N(0, I/d); label ~ Bernoulli(sigmoid(k1 <2/(1+k) (a + k|e| b), z>))."""
    scale = 1.0 / np.sqrt(spec.features)
    base = rng.normal(0.0, scale, spec.features)
    bias = rng.normal(0.0, scale, spec.features)
    z = rng.normal(0.0, scale, (spec.records, spec.features))
    truth = (2.0 / (1.0 + spec.bias_scale)) * (base[None, :] + spec.bias_scale * arity[:, None] * bias[None, :])
    logits = spec.steepness * np.einsum("ij,ij->i", truth, z)
    labels = (rng.random(spec.records) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int64)
    return z.astype(np.float32), labels


def generate(spec: GraphSpec) -> SyntheticData:
    rng = np.random.default_rng(spec.seed)
    make_graph = _regular_graph if spec.graph == "regular" else _skewed_graph
    offsets, users = make_graph(spec, rng)
    if spec.task == "text":
        texts, topics = documents(offsets, users, spec.seed)
        return SyntheticData(offsets=offsets, users=users, features=None, labels=topics, texts=texts)
    features, labels = _logistic_content(spec, np.diff(offsets), rng)
    return SyntheticData(offsets=offsets, users=users, features=features, labels=labels)


USERS_AS = ("users", "from-to-cc", "both")  # `madp generate --users-as`: how the users are written
SENDER_IN_CC_EVERY = 8  # records with id % 8 == 3 also list their sender in cc, as senders copying themselves do


def to_table(data: SyntheticData, users_as: str = "users") -> pa.Table:
    """Records as rows: integer id, users, and the content (features or text, and the label). The
    users are a `users` list, or (`users_as`) as an email export holds them: `from` (the first user),
    `to` and `cc` (lists; cc null where empty), whose union is the same users (`--users-columns
    from,to,cc`), or both."""
    if users_as not in USERS_AS:
        raise InputError(f"--users-as must be one of {', '.join(USERS_AS)}")
    n = len(data.labels)
    records = {"id": pa.array(np.arange(n, dtype=np.int64))}
    if users_as != "from-to-cc":
        records["users"] = pa.ListArray.from_arrays(pa.array(data.offsets, pa.int32()), pa.array(data.users))
    if users_as != "users":
        records.update(_email_columns(data.offsets, data.users))
    if data.features is None:
        return pa.table({**records, "text": pa.array(data.texts, pa.string()), "label": pa.array(data.labels.tolist())})
    features = pa.FixedSizeListArray.from_arrays(pa.array(data.features.ravel()), data.features.shape[1])
    return pa.table({**records, "features": features, "label": pa.array(data.labels)})


def _email_columns(offsets: np.ndarray, users: np.ndarray) -> dict[str, pa.Array]:
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
    echo = np.flatnonzero(np.arange(records) % SENDER_IN_CC_EVERY == 3)
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
    directory = not output.endswith((".jsonl", ".parquet"))
    if directory and not 1 <= shards <= spec.records:  # before anything is written
        raise InputError(f"--shards must be between 1 and --records ({spec.records}): more would write empty files")
    earlier = storage.written_files(output, _is_shard, "madp generate") if directory else []
    table = to_table(data, users_as)
    held_out = 0
    if holdout is not None:
        if not 0 < holdout_fraction < 1 or not holdout.endswith((".jsonl", ".parquet")):
            raise InputError("--holdout must be a .jsonl or .parquet file and --holdout-fraction in (0, 1)")
        chosen = np.random.default_rng([spec.seed, 1]).random(len(table)) < holdout_fraction
        _write_table(table.filter(pa.array(chosen)), holdout)
        table, held_out = table.filter(pa.array(~chosen)), int(chosen.sum())
    if not directory:
        _write_table(table, output)
    else:
        os.makedirs(output, exist_ok=True)
        bounds = np.linspace(0, len(table), shards + 1).astype(int)
        written = [
            os.path.join(os.path.abspath(output), f"part-{shard:05d}-of-{shards:05d}.parquet")
            for shard in range(shards)
        ]
        for shard, path in enumerate(written):
            storage.write_parquet(table.slice(bounds[shard], bounds[shard + 1] - bounds[shard]), path)
        storage.remove_written(output, [path for path in earlier if path not in written])
    degree = np.bincount(data.users)
    degree = degree[degree > 0]
    return {
        "output": output,
        "records": len(table),
        "held_out_records": held_out,
        "incidences": len(data.users),
        "users": len(degree),
        "mean_users_per_record": round(len(data.users) / max(len(table), 1), 4),
        "max_records_per_user": int(degree.max(initial=0)),
        "median_records_per_user": float(np.median(degree)),
        **(
            {"labels": {str(k): int(v) for k, v in zip(*np.unique(data.labels, return_counts=True))}}
            if data.texts is not None
            else {"positive_labels": round(float(data.labels.mean()), 4)}
        ),
        "graph": spec.graph,
        "seed": spec.seed,
    }
