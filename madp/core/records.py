"""Multi-user records in columnar form: the reasons a row is rejected, the chunks valid records
make, the input files of a path, and merging chunks (a duplicated id rejects every row holding it).

A record is a row with an id (integer or string, unique) and a non-empty list of user
ids (integers or strings). Both engines read rows with `record_reading` (Beam a large file in
splits, `input_splits`), judge the rules over whole files and the whole input with
`record_reading.check_facts`, and merge chunks with `merge_chunks`, so they accept and reject
exactly the same rows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from madp.core import storage
from madp.core.columnar import Columnar, dense_codes
from madp.core.errors import InputError, OptionError
from madp.core.hashing import partition_of
from madp.core.options import check_choices, option
from madp.core.routing import split_rows
from madp.core.user_ids import USER_IDS, SuspectUserIds

log = logging.getLogger("madp")

INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")

# Why a row is rejected, in the order checks run.
MISSING_ID = "missing_id"
BAD_ID_TYPE = "bad_id_type"
MISSING_USERS = "missing_users"
EMPTY_USERS = "empty_users"
NULL_USER = "null_user"
NON_SCALAR_USER = "non_scalar_user"
BAD_USER_TYPE = "bad_user_type"
BAD_ADDRESS = "bad_address"  # --user-ids email: a user value holding no e-mail address
BAD_WEIGHT = "bad_weight"
INVALID_JSON = "invalid_json"
DUPLICATE_ID = "duplicate_id"
NULL_CONTENT = "null_content"  # batching: a selected record's content value is null
NON_FINITE_CONTENT = "non_finite_content"  # batching: ... or a NaN, infinite or beyond-float32 float
REJECT_REASONS = (
    INVALID_JSON,
    MISSING_ID,
    BAD_ID_TYPE,
    MISSING_USERS,
    EMPTY_USERS,
    NULL_USER,
    NON_SCALAR_USER,
    BAD_USER_TYPE,
    BAD_ADDRESS,
    BAD_WEIGHT,
    DUPLICATE_ID,
    NULL_CONTENT,
    NON_FINITE_CONTENT,
)

ROW_KEY_BITS = 40  # record key = file index << 40 | row: unique without any global pass
# The input a report names for a Spark DataFrame of records (`madp.spark.dataframe`), where a path
# would be; its partition p reads as the input file of index p, named `dataframe_partition(p)`.
DATAFRAME = "<DataFrame>"


def dataframe_partition(index: int) -> str:
    """The source that rejects and errors name for partition `index` of a DataFrame input."""
    return f"{DATAFRAME} partition {index}"


@dataclasses.dataclass(frozen=True)
class Columns:
    """The input columns of a record. Its users are the list column `users`, or with `users_columns`
    (`--users-columns from,to,cc`) the union of those columns' values, each a user id or a list of
    them (null, "" and [] adding none); `users` then only names the union once read. `user_ids`
    (`--user-ids`) says how string user ids are read: None, as they are once none shows a sign of
    naming a person under several ids (`user_ids.SIGNS`); "email", as the e-mail addresses they
    hold; "as-is", as they are."""

    id: str = "id"
    users: str = "users"
    weight: str | None = None
    users_columns: tuple[str, ...] = ()
    user_ids: str | None = None

    def __post_init__(self) -> None:
        if self.user_ids not in (None, *USER_IDS):
            raise OptionError("{user_ids} {0}: one of {1}", self.user_ids, ", ".join(USER_IDS))
        names = self.users_columns
        if not names:
            return
        if any(not name for name in names) or len(set(names)) < len(names):
            raise OptionError("{users_columns} {0}: name each column once, none empty", ",".join(names))
        clash = [name for name in names if name in (self.id, self.weight)]
        if clash:
            raise OptionError("{users_columns}: {0!r} is also the id or weight column", clash[0])

    @property
    def user_sources(self) -> tuple[str, ...]:
        """The input columns a record's users are read from."""
        return self.users_columns or (self.users,)

    def users_flags(self) -> str:
        """The users option these columns come from, as a user would type it (for messages)."""
        if self.users_columns:
            return f"--users-columns {','.join(self.users_columns)}"
        return f"--users-column {self.users}"


def users_columns_of(names: str | list | tuple | None) -> tuple[str, ...]:
    """`--users-columns from,to,cc` (or a config's list of them) as a tuple of names; () for none."""
    if names is None:
        return ()
    listed = names.split(",") if isinstance(names, str) else [str(name) for name in names]
    return tuple(name.strip() for name in listed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColumnOptions:
    """Where a record's id and users are, as the commands that read records take them (`--id-column`,
    `--users-column` or `--users-columns`, `--user-ids`); `columns` is the `Columns` they name. Keyword
    arguments, after a subclass's own options."""

    id_column: str = option("id", help="column holding the record id (default: id)")
    users_column: str | None = option(None, help="column holding the list of user ids (default: users)")
    users_columns: tuple[str, ...] = option(
        (),
        parse=users_columns_of,
        metavar="A,B,...",
        help="columns whose values' union are a record's users, each a user id or a list of them; null, '' "
        "and [] add none (e.g. from,to,cc of an email export); instead of --users-column",
    )
    user_ids: str | None = option(
        None,
        choices=USER_IDS,
        help="how string user ids are read: 'email' (each value's e-mail addresses are its users: display "
        "names, comments and 'mailto:' dropped, split at ',', ';' and '|', lower-cased) or 'as-is'; by default an "
        "id that may name a person under several ids (surrounding whitespace, or holding '@' and no plain "
        "lower-case address: 'Ann <ann@x>', 'a@x; b@y', 'ANN@X', 'mailto:ann@x') is an error",
    )

    def __post_init__(self) -> None:
        # --users-column and --users-columns are two ways to say where the users are
        if self.users_columns and self.users_column is not None:
            raise OptionError(
                "{users_column} {0} and {users_columns} {1}: give one of them ({users_columns} reads the users "
                "from several columns, {users_column} from one list column)",
                self.users_column,
                ",".join(self.users_columns),
            )
        check_choices(self)
        # built (a subclass's with its weight column), and so checked
        self.columns  # noqa: B018

    @property
    def columns(self) -> Columns:
        return self.record_columns()

    def record_columns(self, weight: str | None = None) -> Columns:
        """The columns these options name, with a `weight` column if any."""
        return Columns(self.id_column, self.users_column or "users", weight, self.users_columns, self.user_ids)


@dataclasses.dataclass
class Rejects:
    """Rejected rows: where they are, why, and what they held (as JSON text)."""

    file: list[str] = dataclasses.field(default_factory=list)
    row: list[int] = dataclasses.field(default_factory=list)
    reason: list[str] = dataclasses.field(default_factory=list)
    record: list[str] = dataclasses.field(default_factory=list)

    def add(self, file: str, row: int, reason: str, record: object) -> None:
        self.file.append(file)
        self.row.append(int(row))
        self.reason.append(reason)
        self.record.append(json.dumps(record, default=str, sort_keys=True))

    def extend(self, other: Rejects) -> None:
        for name in ("file", "row", "reason", "record"):
            getattr(self, name).extend(getattr(other, name))

    def counts(self) -> dict[str, int]:
        return {r: self.reason.count(r) for r in REJECT_REASONS if r in self.reason}

    def __len__(self) -> int:
        return len(self.reason)

    @classmethod
    def from_jsonl(cls, text: str) -> Rejects:
        rejects = cls()
        for line in text.splitlines():
            row = json.loads(line)
            rejects.add(row["file"], row["row"], row["reason"], row["record"])
        return rejects

    def to_jsonl(self) -> str:
        rows = sorted(zip(self.file, self.row, self.reason, self.record))
        return "".join(
            json.dumps({"file": f, "row": r, "reason": why, "record": json.loads(rec)}) + "\n"
            for f, r, why, rec in rows
        )


@dataclasses.dataclass
class RecordChunk(Columnar):
    """Valid records in columnar form: users as a CSR list (offsets into `users`)."""

    keys: np.ndarray  # int64, unique per record across the whole input
    ids: pa.Array  # int64 or string
    offsets: np.ndarray  # int64, len(ids) + 1
    users: pa.Array  # flat user ids, int64 or string, no repeats within a record
    weights: np.ndarray | None
    sources: dict[int, str]  # input file of each file index in `keys`
    content: pa.Table | None = None  # other columns carried along (batching), one row per record

    def __len__(self) -> int:
        return len(self.ids)

    def source(self, record: int) -> tuple[str, int]:
        """(file, row) a record was read from."""
        key = int(self.keys[record])
        return self.sources[key >> ROW_KEY_BITS], key & ((1 << ROW_KEY_BITS) - 1)

    @property
    def arity(self) -> np.ndarray:
        return np.diff(self.offsets)


class ReadFacts(NamedTuple):
    """What the rules over a whole file and over the whole input need of one read (a file, or a split
    of one, which may be read on another worker): `record_reading.check_facts` judges them all."""

    file_index: int
    source: str
    first_row: int  # of the rows read, in the file
    # the columns some row has (of a JSON Lines read at once, the record's only: `record_reading.read_jsonl`);
    # None when no row is a JSON object
    columns: frozenset[str] | None
    id_type: pa.DataType | None  # of the non-null ids of the rows read (valid or not); None: none
    user_type: pa.DataType | None  # likewise of their user ids
    content: pa.Schema | None = None  # the content columns some row has, with their types as read
    suspect_users: SuspectUserIds | None = None  # user ids showing a sign (read with user_ids None), or None


@dataclasses.dataclass
class FileResult:
    chunk: RecordChunk
    rejects: Rejects
    rows_read: int
    repeated_users_removed: int
    facts: ReadFacts

    def stats(self) -> dict[str, int]:
        """What the read counts for the run's summary, by name: rows read, rejected rows by reason,
        repeated users removed from records."""
        rejected = {f"rejected_{reason}": count for reason, count in self.rejects.counts().items()}
        return {"input_rows": self.rows_read, **rejected, "repeated_users_removed": self.repeated_users_removed}


def list_input_files(path: str) -> list[str]:
    """The input files of a path: the file itself, or every .jsonl, .jsonl.gz or .parquet file below a
    directory (files and directories whose names start with '.' or '_' skipped; a link loop is an
    error); other files there are named in a warning."""
    found = storage.kind(path)
    if found == "directory":
        visible = _visible_files(path)
        files = [f for f in visible if f.endswith(INPUT_SUFFIXES)]
        ignored = [f for f in visible if not f.endswith(INPUT_SUFFIXES)]
        if ignored:
            log.warning(
                "%s: %d files are not read (only %s are): %s",
                path,
                len(ignored),
                ", ".join(INPUT_SUFFIXES),
                ", ".join(ignored[:10]) + (" ..." if len(ignored) > 10 else ""),
            )
        if not files:
            raise InputError(f"{path}: directory holds no {', '.join(INPUT_SUFFIXES)} files")
        return files
    if found == "missing":
        raise InputError(f"{path}: no such file or directory")
    if not path.endswith(INPUT_SUFFIXES):
        raise InputError(f"{path}: unsupported input format (expected {', '.join(INPUT_SUFFIXES)})")
    return [path]


def _visible_files(directory: str) -> list[str]:
    """The files below an input directory, none under a name starting with '.' or '_' at any level:
    notebooks' `.ipynb_checkpoints/` and Spark's `_temporary/` hold copies, not records."""
    return storage.list_files(directory, skip_hidden=True)


def ignored_input_files(path: str) -> list[str]:
    """Files of an input directory that are not read for their suffix (e.g. .JSONL, .parq, .csv)."""
    if storage.kind(path) != "directory":
        return []
    return [f for f in _visible_files(path) if not f.endswith(INPUT_SUFFIXES)]


def merge_chunks(chunks: list[RecordChunk]) -> RecordChunk:
    """Concatenate chunks (in the given order) into one."""
    non_empty = [c for c in chunks if len(c)] or chunks[:1]
    check_same_type([c.ids.type for c in non_empty], "record")
    check_same_type([c.users.type for c in non_empty if len(c.users)], "user")
    sources = {index: path for c in non_empty for index, path in c.sources.items()}
    offsets = [non_empty[0].offsets[:1]]
    base = 0
    for c in non_empty:
        offsets.append(c.offsets[1:] + base)
        base += int(c.offsets[-1])
    weights = None if non_empty[0].weights is None else np.concatenate([c.weights for c in non_empty])
    content = None
    if non_empty[0].content is not None:
        try:
            content = pa.concat_tables([c.content for c in non_empty], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
            raise InputError(f"content columns have different types in different input files: {error}") from error
    return RecordChunk(
        keys=np.concatenate([c.keys for c in non_empty]),
        ids=pa.concat_arrays([c.ids for c in non_empty]),
        offsets=np.concatenate(offsets),
        users=pa.concat_arrays([c.users for c in non_empty]),
        weights=weights,
        sources=sources,
        content=content,
    )


def check_same_type(types: list[pa.DataType], what: str) -> None:
    if len(set(types)) > 1:
        raise InputError(
            f"{what} ids mix integers and strings across input files ({sorted(map(str, set(types)))}); "
            f"use one type per column"
        )


def duplicate_id_mask(ids: pa.Array) -> np.ndarray:
    """True for every record whose id occurs more than once (all occurrences: none is preferred)."""
    if len(ids) == 0:
        return np.zeros(0, dtype=bool)
    codes, _ = dense_codes(ids)
    return np.bincount(codes)[codes] > 1


def take(chunk: RecordChunk, index: np.ndarray) -> RecordChunk:
    """The records of `chunk` at the positions `index` (in that order), users and all."""
    arity = chunk.arity[index]
    offsets = np.concatenate([[0], np.cumsum(arity)]).astype(np.int64)
    flat_index = np.repeat(chunk.offsets[:-1][index], arity) + (np.arange(offsets[-1]) - np.repeat(offsets[:-1], arity))
    return RecordChunk(
        keys=chunk.keys[index],
        ids=chunk.ids.take(pa.array(index)),
        offsets=offsets,
        users=chunk.users.take(pa.array(flat_index)),
        weights=None if chunk.weights is None else chunk.weights[index],
        sources=chunk.sources,
        content=None if chunk.content is None else chunk.content.take(pa.array(index)),
    )


def by_record_partition(chunk: RecordChunk, partitions: int) -> list[tuple[int, RecordChunk]]:
    """(record partition, the chunk's records in it, in chunk order) for each partition it has
    records of, by id hash (`partition_of`): the records' side of every join on the record partition."""
    partition = partition_of(chunk.ids, partitions) if len(chunk) else np.zeros(0, np.int64)
    return [(part, take(chunk, rows)) for part, rows in split_rows(partition)]


def reject_duplicates(chunk: RecordChunk, rejects: Rejects) -> RecordChunk:
    """Move every record with a duplicated id from `chunk` to `rejects`."""
    duplicated = duplicate_id_mask(chunk.ids)
    for i in np.flatnonzero(duplicated):
        users = chunk.users[int(chunk.offsets[i]) : int(chunk.offsets[i + 1])].to_pylist()
        rejects.add(*chunk.source(int(i)), DUPLICATE_ID, {"id": chunk.ids[int(i)].as_py(), "users": users})
    return take(chunk, np.flatnonzero(~duplicated)) if duplicated.any() else chunk


def merged_records(chunks: Iterable[RecordChunk], rejects: Rejects) -> RecordChunk:
    """A record partition's chunks as one chunk in key order (whatever order the engine delivered
    them in); its duplicated ids go to `rejects`."""
    ordered = sorted(chunks, key=lambda c: int(c.keys[0]))
    return reject_duplicates(merge_chunks(ordered), rejects)


def merge_rejects(batches: Iterable[Rejects]) -> Rejects:
    """The rejected rows of every batch, as one `Rejects`."""
    merged = Rejects()
    for batch in batches:
        merged.extend(batch)
    return merged
