"""Batch materialization shared by both engines: options, and the inputs (the selection joined with
the records, content checks, the keys of units and users). The files are `batch_files`, the report
`batch_report`, the in-memory engine `batch_local`, the Beam one `madp.beam.batch`.

Flow: selected ids + copies (a `madp bound` output) joined with the records (users, content) ->
units (one per copy) -> sampled (unit, step) rows -> per step: order, truncate, pad -> TFRecords.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from madp.core import records as rec
from madp.core import sampling, storage, tfrecord
from madp.core.batch_files import PADDING_ID, RESERVED_FEATURES, BatchSchema, Feature, is_list
from madp.core.batch_steps import (
    Incidences,
    JoinedPartition,
    SelectedIds,
    histogram_arrays,
    incidences_by_user_partition,
)
from madp.core.errors import InputError, positive
from madp.core.graph_digest import SCHEME, GraphDigest, graph_digest
from madp.core.hashing import hash_ids, id_words, siphash24, siphash24_bytes
from madp.core.options import comma_names, option, refuse_failed, seed_argument
from madp.core.randomness import DETERMINISTIC, SecretKey
from madp.core.selection import REPORT_FILE, read_bound_report
from madp.core.user_ids import USER_IDS

SAMPLERS = ("minsep", "minsep-greedy", "users")
RECORD_STREAM, USER_STREAM, USER_SAMPLING_STREAM = 7, 8, 9  # unit keys (keyed), user identity, user sampling (keyed)
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the batches' floats are float32
STRING_STREAMS = 100  # string ids hash under subkey(stream + STRING_STREAMS), integers under subkey(stream)


@dataclasses.dataclass(frozen=True)
class BatchOptions(rec.ColumnOptions):
    """The options of `madp batch` (each field its `--flag`), checked when built."""

    steps: int = option(help="T: training steps (batches)")
    batch_size: float = option(help="B: expected batch size (minsep) or exact batch size (minsep-greedy)")
    sampler: str = option(
        "minsep",
        choices=SAMPLERS,
        help="minsep: multi-attribution b-min-sep Poisson sampling (default); "
        "minsep-greedy: deterministic batches of exactly B; users: Poisson sampling of "
        "users (single-attribution records), B = expected users per step",
    )
    min_sep: int = option(1, help="b: steps between a user's participations (default 1: plain Poisson sampling)")
    warm_up: int | None = option(None, help="minsep: simulated steps dropped first (default b-1: stationary)")
    max_batch_size: int | None = option(
        None, help="B_max: truncate larger batches at random, pad smaller ones with weight-0 rows"
    )
    find_max_min_sep: bool = option(
        False, help="minsep-greedy: use the largest b for which the greedy finds a solution"
    )
    seed: int | None = option(  # None: a fresh secret sampling key; an int reproduces (not private)
        None,
        parse=seed_argument,
        help="TESTING ONLY: reproduce the sampling from this seed; the batches are then not private "
        "(default: a fresh secret key per run, never written)",
    )
    content_columns: tuple[str, ...] | None = option(
        None,
        parse=comma_names,
        help="comma-separated columns to carry (default: every column of DATA but id, users and weight)",
    )
    on_invalid: str = option(
        "error",
        choices=("error", "skip"),
        help="invalid DATA rows: stop (default) or skip them into OUTPUT/rejected/",
    )
    output_shards: int = option(1, help="TFRecord files (contiguous step ranges)")

    if TYPE_CHECKING:  # set per instance by __post_init__; no field, so never in a report or a repr
        key: ClassVar[SecretKey]

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_failed(
            [
                (self.steps >= 1, "{steps} must be at least 1"),
                (positive(self.batch_size), "{batch_size} must be positive and finite"),
                (self.min_sep >= 1, "{min_sep} must be at least 1 (1 is plain Poisson sampling)"),
                (self.warm_up is None or self.warm_up >= 0, "{warm_up} must be at least 0"),
                (self.max_batch_size is None or self.max_batch_size >= 1, "{max_batch_size} must be at least 1"),
                (self.output_shards >= 1, "{output_shards} must be at least 1"),
                (
                    self.sampler == "minsep-greedy" or not self.find_max_min_sep,
                    "{find_max_min_sep} applies to {sampler} minsep-greedy",
                ),
                (
                    self.sampler != "users" or self.min_sep == 1,
                    "{sampler} users is plain Poisson sampling over users: {min_sep} must be 1",
                ),
                (
                    self.sampler != "minsep-greedy" or float(self.batch_size).is_integer(),
                    "{batch_size} must be an integer for {sampler} minsep-greedy (batches have exactly B records)",
                ),
            ]
        )
        # Drawn once per run (by the driver: Beam workers get it with the pipeline), never reported.
        object.__setattr__(self, "key", SecretKey.for_run(self.seed, "batch sampling", "--seed"))

    @property
    def sampling(self) -> str:
        """What the batches' privacy rests on: a secret key, a fixed seed, or (greedy) nothing secret."""
        return DETERMINISTIC if self.sampler == "minsep-greedy" else self.key.status

    @property
    def warm_up_steps(self) -> int:
        """Exclusion looks back b-1 steps at i.i.d. samples, so batch sizes are exactly stationary after b-1."""
        if self.sampler != "minsep":
            return 0
        return self.min_sep - 1 if self.warm_up is None else self.warm_up

    @property
    def sampled_steps(self) -> int:
        """Steps sampled: the warm-up's, then the training's."""
        return self.warm_up_steps + self.steps


# --- inputs -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BoundGraph:
    """The graph a `madp bound` output was bounded from, as its report records it: DATA must have the
    same (`check_same_graph`), read with the same columns (the weight column too: its invalid values
    reject rows)."""

    selected: str  # the bound output, named in errors
    digest: GraphDigest
    id_column: str
    users_column: str
    weight_column: str | None
    users_columns: tuple[str, ...] = ()  # --users-columns: the users were the union of these columns
    user_ids: str | None = None  # --user-ids: how the bound read string user ids (None: checked)

    def column_flags(self) -> str:
        """The id and users options the bound read the records with, as a user would pass them."""
        users = f"--users-columns {','.join(self.users_columns)}" if self.users_columns else None
        read = f" --user-ids {self.user_ids}" if self.user_ids else ""
        return f"--id-column {self.id_column} {users or f'--users-column {self.users_column}'}{read}"

    def columns(self, columns: rec.Columns) -> rec.Columns:
        """`columns` (the batch's id and users columns) with the bound's weight column, which reading
        validates as the bound did (the weight column is no more than that for batching), and the
        bound's reading of user ids, which the batch's --user-ids, when given, must repeat."""
        if columns.user_ids is not None and columns.user_ids != self.user_ids:
            raise InputError(
                f"--user-ids {columns.user_ids}: {self.selected} read the user ids "
                f"{f'with --user-ids {self.user_ids}' if self.user_ids else 'without --user-ids'}; batch reads "
                f"them as the bound did: leave --user-ids out or give the bound's"
            )
        return dataclasses.replace(columns, weight=self.weight_column, user_ids=self.user_ids)


def bound_graph(selected: str) -> BoundGraph:
    """What `madp batch` checks DATA against, from SELECTED/report.json (read after `selection_files`
    found it); a report without a graph digest (madp before it had one) is refused."""
    bound = read_bound_report(selected)
    if bound.graph_digest is None:
        raise InputError(
            f"{storage.join(selected, REPORT_FILE)} has no graph_digest of this madp (not a graph digest of scheme "
            f"{SCHEME}): it was written by an older madp bound; re-run madp bound on the records, then batch"
        )
    parameters = bound.parameters
    if parameters.user_ids not in (None, *USER_IDS):
        raise InputError(
            f"{storage.join(selected, REPORT_FILE)}: parameters.user_ids {parameters.user_ids!r} is not madp's"
        )
    return BoundGraph(
        selected,
        bound.graph_digest,
        parameters.id_column,
        parameters.users_column or "users",
        parameters.weight_column,
        rec.users_columns_of(parameters.users_columns),
        parameters.user_ids,
    )


def check_same_graph(found: GraphDigest, bound: BoundGraph, data: str) -> None:
    """Refuse DATA whose valid records' graph (ids and users, not content) is not the bounded one: the
    contribution bound, which training accounts with, holds for the bounded graph only."""
    if found != bound.digest:
        expected = bound.digest
        raise InputError(
            f"DATA {data} is not the graph SELECTED {bound.selected} was bounded from (graph digest "
            f"{found.hex} != {expected.hex}; {found.records} records with {found.incidences} user "
            f"incidences, against {expected.records} with {expected.incidences}): pass the records and "
            f"the --id-column/--users-column (or --users-columns) the bound used ({bound.column_flags()})"
        )


def join_selection(
    chunk: rec.RecordChunk, ids: pa.Array, copies: np.ndarray, data: str
) -> tuple[rec.RecordChunk, np.ndarray]:
    """The selected records of `chunk` (in selection order) and their copies; every selected id must be there."""
    if len(ids) and len(chunk) and ids.type != chunk.ids.type:
        raise InputError(
            f"selected ids are {ids.type} but the ids of {data} are {chunk.ids.type}: "
            f"was SELECTED bounded from this data with the same --id-column?"
        )
    if rec.duplicate_id_mask(ids).any():
        raise InputError("a selected id is listed twice in SELECTED/selected/")
    reserved = pa.scalar(PADDING_ID if pa.types.is_integer(ids.type) else "", ids.type) if len(ids) else None
    if reserved is not None and pc.any(pc.equal(ids, reserved)).as_py():
        raise InputError(
            f"selected record id {reserved.as_py()!r} is the id of padding rows in batches: give that record another id"
        )
    position = pc.index_in(ids, value_set=chunk.ids) if len(chunk) else pa.nulls(len(ids), pa.int32())
    missing = position.is_null().to_numpy(zero_copy_only=False)
    if missing.any():
        shown = ", ".join(repr(v) for v in ids.filter(pa.array(missing))[:10].to_pylist())
        raise InputError(
            f"{int(missing.sum())} selected ids are not valid records of {data} (e.g. {shown}): "
            f"was SELECTED bounded from this data?"
        )
    index = position.to_numpy(zero_copy_only=False).astype(np.int64)
    mask = np.zeros(len(chunk), dtype=bool)
    mask[index] = True
    selected = rec.take(chunk, np.flatnonzero(mask))  # in chunk order; `copies` follows it
    order = np.argsort(index, kind="stable")
    return selected, copies[order]


def _content_problems(content: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(reason, column) per row where a content value cannot be trained on ("" where all can): a
    null (the value, or one inside its list), or a NaN or infinite float, or one beyond float32's
    range, which the batches would hold as infinite (a NaN model)."""
    reason = np.full(len(content), "", dtype=object)
    where = np.full(len(content), "", dtype=object)
    for name in content.column_names:
        column = content.column(name).combine_chunks()
        values = pc.list_flatten(column) if is_list(column.type) else column
        null = column.is_null().to_numpy(zero_copy_only=False)
        if values.null_count:
            null |= _rows_of_values(column, values.is_null().to_numpy(zero_copy_only=False))
        bad = [(null, rec.NULL_CONTENT)]
        if pa.types.is_floating(values.type) and len(values):
            # the batches hold float32 (tf.train.FloatList): a larger magnitude would be written as inf
            representable = pc.and_(pc.is_finite(values), pc.less_equal(pc.abs(values), FLOAT32_MAX))
            finite = pc.fill_null(representable, True).to_numpy(zero_copy_only=False)
            bad.append((_rows_of_values(column, ~finite), rec.NON_FINITE_CONTENT))
        for flags, why in bad:
            new = flags & (reason == "")
            reason[new], where[new] = why, name
    return reason, where


def _rows_of_values(column: pa.Array, flags: np.ndarray) -> np.ndarray:
    """Rows of `column` with a flagged value (its values flattened where it holds lists)."""
    if not is_list(column.type):
        return flags
    found = np.zeros(len(column), dtype=bool)
    found[pc.list_parent_indices(column).to_numpy()[flags]] = True
    return found


def skip_invalid_content(chunk: rec.RecordChunk, rejects: rec.Rejects) -> np.ndarray:
    """`--on-invalid skip`: which selected records of `chunk` can be written (True); those with
    `_content_problems` are added to `rejects`. They stay in the sampling population (|N(e)|, p, and
    min-sep exclusion of their users) and only their rows are left out of the batches
    (`batch_steps.writable_rows`), so p and the schedule are functions of the graph only, never of content. A
    left-out row is the zero-gradient record of the neighbouring relation: the accounting holds."""
    # Nothing to check; a table without columns may not hold its row count.
    if chunk.content is None or not chunk.content.num_columns:
        return np.ones(len(chunk), dtype=bool)
    reason, where = _content_problems(chunk.content)
    bad = reason != ""
    for row in np.flatnonzero(bad).tolist():
        users = chunk.users[int(chunk.offsets[row]) : int(chunk.offsets[row + 1])].to_pylist()
        record = {"id": chunk.ids[row].as_py(), "users": users, "column": where[row]}
        rejects.add(*chunk.source(row), reason[row], record)
    return ~bad


def check_content(content: pa.Table, ids: pa.Array, valid: np.ndarray | None = None) -> dict[str, Feature]:
    """Feature description of each content column over the records whose rows are written (`valid`,
    default all: rows left out by `skip_invalid_content` must not shape the schema); a null or
    non-finite value in one of them is an error."""
    if valid is not None and not valid.all():  # (a table without columns may not hold its row count)
        content, ids = content.filter(pa.array(valid)), ids.filter(pa.array(valid))
    for name in content.column_names:
        if name in RESERVED_FEATURES:
            raise InputError(
                f"content column {name!r} has the name of a batch feature {RESERVED_FEATURES}; "
                f"choose the columns with --content-columns"
            )
    reason, where = _content_problems(content)
    if (reason != "").any():
        row = int(np.flatnonzero(reason != "")[0])
        problem = "is null" if reason[row] == rec.NULL_CONTENT else "holds a NaN, infinite or beyond-float32 value"
        raise InputError(
            f"content column {where[row]!r} {problem} for selected record {ids[row].as_py()!r}; fix the "
            f"record, leave the column out with --content-columns, or pass --on-invalid skip"
        )
    described: dict[str, Feature] = {}
    for name in content.column_names:
        column = content.column(name).combine_chunks()
        values = pc.list_flatten(column) if is_list(column.type) else column
        try:
            kind = tfrecord.feature_kind(values.type)
        except ValueError as error:
            raise InputError(f"content column {name!r}: {error}; leave it out with --content-columns") from error
        shape: tuple[int | None, ...]
        if pa.types.is_fixed_size_list(column.type):
            shape = (column.type.list_size,)
        elif is_list(column.type):
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            shape = (int(lengths[0]),) if len(lengths) and (lengths == lengths[0]).all() else (None,)
        else:
            shape = ()
        described[name] = Feature(name, kind, shape)
    return described


def calibrated_probability(histogram: dict[int, int], options: BatchOptions) -> float:
    """p for the options' expected batch size, on the {|N(e)|: units} histogram of all units."""
    return sampling.calibrate_probability(options.batch_size, *histogram_arrays(histogram), options.min_sep)


def schema(id_type: pa.DataType, content: Mapping[str, Feature], options: BatchOptions) -> BatchSchema:
    features = {
        "step": Feature("step", tfrecord.INT64, ()),
        "id": Feature("id", tfrecord.feature_kind(id_type), ()),
        "weight": Feature("weight", tfrecord.FLOAT, ()),
        **content,
    }
    return BatchSchema(features, options.steps, options.max_batch_size)


# --- units and users ----------------------------------------------------------------------------


def keyed_id_hashes(ids: pa.Array, key: SecretKey, stream: int) -> np.ndarray:
    """A keyed PRF of each whole id under `key`'s `stream` subkey: SipHash-2-4 of an integer id's 8-byte
    word, of a string id's UTF-8 bytes (all of them: no unkeyed pre-hash that two chosen ids could
    share). The two kinds use independent subkeys, so an integer and an 8-byte string never meet in
    one PRF even where a run mixed them (the local engine refuses that; Beam partitions might not)."""
    if not len(ids):
        return np.zeros(0, np.uint64)
    if pa.types.is_integer(ids.type):
        return siphash24(key.subkey(stream), id_words(ids))
    return siphash24_bytes(key.subkey(stream + STRING_STREAMS), ids)


def record_hashes(ids: pa.Array, key: SecretKey) -> np.ndarray:
    """Each record's 64-bit sampling key: a keyed PRF of its whole id, unpredictable without `key`."""
    return keyed_id_hashes(ids, key, RECORD_STREAM)


def user_hashes(users: pa.Array, key: SecretKey) -> np.ndarray:
    """64-bit user identity: of min-sep exclusion, of user-level sampling (its keys are a keyed PRF of
    this) and of the users sampler's `user` feature (per-user clipping). An integer user's is a
    public bijection of its id, so two users never share one; a string user's is a keyed PRF of its
    whole id, so two share one only by chance (about n^2 / 2^65 for n users), never by choice of ids.
    A shared identity would merge two users: harmless for exclusion (more of it, never less) but not
    for sampling or clipping, whose independence per user the accounting assumes."""
    if not len(users):
        return np.zeros(0, np.uint64)
    if pa.types.is_integer(users.type):
        return hash_ids(users, 0, purpose=USER_STREAM)
    return keyed_id_hashes(users, key, USER_STREAM)


# --- the join, one record partition at a time ----------------------------------------------------


class JoinedRecords(NamedTuple):
    """What `join_partition` gives for a record partition: its joined records (kept there), their
    incidences by user partition, and what the report and the schema need of them."""

    joined: JoinedPartition
    incidences: list[tuple[int, Incidences]]
    rejects: rec.Rejects  # records left out for their content (--on-invalid skip)
    written_records: int  # records whose rows are written (valid content)
    content: dict[str, Feature]  # the content's description over those records
    records: int  # selected records joined
    id_type: pa.DataType


def join_partition(
    chunk: rec.RecordChunk | None,
    selection: Sequence[SelectedIds],
    options: BatchOptions,
    data: str,
    partitions: int,
) -> JoinedRecords:
    """The join of b-min-sep batching over a bound selection, for one record partition: its valid
    records (`chunk`, None where it has none) joined with the selected ids sent to it (`join_selection`),
    their content checked (`check_content`; under --on-invalid skip, invalid content is left out of the
    rows, `skip_invalid_content`) and their ids and users keyed; the (user, record) incidences go to
    the users' partitions, where the neighbourhoods are formed."""
    ids = pa.concat_arrays([s.ids for s in selection])
    copies = np.concatenate([s.copies for s in selection])
    if chunk is None:
        raise InputError(
            f"{len(ids)} selected ids are not valid records of {data} "
            f"(e.g. {ids[0].as_py()!r}): was SELECTED bounded from this data?"
        )
    chunk, copies = join_selection(chunk, ids, copies, data)
    rejects = rec.Rejects()
    valid = np.ones(len(copies), dtype=bool)  # under --on-invalid error, check_content refuses invalid content
    if options.on_invalid == "skip":
        valid = skip_invalid_content(chunk, rejects)
    described = check_content(chunk.content, chunk.ids, valid)
    users = user_hashes(chunk.users, options.key)
    record_keys = record_hashes(chunk.ids, options.key)
    joined = JoinedPartition(chunk.ids, copies, chunk.offsets, users, chunk.content, record_keys, valid)
    return JoinedRecords(
        joined,
        incidences_by_user_partition(joined, partitions),
        rejects,
        int(valid.sum()),
        described,
        len(copies),
        chunk.ids.type,
    )


class RecordPartitionJoin(NamedTuple):
    """What `join_record_partition` gives for a record partition: its rows rejected as duplicated ids,
    its part of DATA's graph, and its join (None where no selected id is sent to it)."""

    rejects: rec.Rejects  # records whose id another record has
    digest: GraphDigest | None  # of its valid records, selected or not (None: it has none)
    joined: JoinedRecords | None


def join_record_partition(
    chunks: Sequence[rec.RecordChunk],
    selection: Sequence[SelectedIds],
    options: BatchOptions,
    data: str,
    partitions: int,
) -> RecordPartitionJoin:
    """A record partition's records (the chunks every read sent it, merged whatever their order, their
    duplicated ids rejected) and the selected ids sent to it: the graph digest of its records, taken
    before the join and any content check, and the join (`join_partition`)."""
    rejects = rec.Rejects()
    chunk = rec.merged_records(chunks, rejects) if chunks else None
    digest = None if chunk is None else graph_digest(chunk.ids, chunk.offsets, chunk.users)
    joined = join_partition(chunk, selection, options, data, partitions) if selection else None
    return RecordPartitionJoin(rejects, digest, joined)
