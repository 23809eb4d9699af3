"""The steps of round-based unanimous-proposal bounding (Alg. 1, with Alg. 3's passes) on partitions,
as functions of partitions and messages: what a partitioned engine runs at each step, whichever
engine moves the partitions (Beam's transforms in `madp.beam.bound_build` and `madp.beam.bound_rounds`
only unpack an element, call a step here and emit its result).

The graph is split two ways. A *record partition* (`RecordPartition`) holds whole records by id hash:
their ids, arity and the selection so far; it sends each incidence to the *user partition* of its user
(`Incidences`, one batch per user partition). A user partition (`UserPartition`) holds its users'
incidences in preference order (`bounding.UserSide`) and, per record, what routing needs. One step:

  propose_to_record_partitions: user partition -> `ProposalBatch` per record partition
  select_unanimous:             a record partition's proposal batches -> selected keys, `accepted`
                                keys per user partition
  consume_in_partition:         user partition + its accepted keys -> retired records, their keys
                                per co-owning user partition
  retire_in_partition:          user partition + keys retired elsewhere -> the partition compacted to
                                what can still change, and its counts
  finish_locally:               the user partitions left, merged -> the rest of the rounds on one worker

`Progress` carries the shared control flow (`bounding.Control`) from one step to the next.
"""

from __future__ import annotations

import dataclasses
import pickle
import typing

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from madp.core import records as rec
from madp.core.bounding import (
    DONE,
    ROUND,
    Capacities,
    Control,
    UserSide,
    build_user_side,
    certified_records,
    compact,
    consume_and_retire,
    local_mask,
    merge_sides,
    preference_keys,
    preference_rank_order,
    propose,
    retire,
    run_steps,
    unanimous,
)
from madp.core.columnar import Columnar, dense_codes
from madp.core.graph_digest import graph_digest
from madp.core.hashing import partition_of
from madp.core.routing import csr_rows, distinct_partitions, split_by_partition, split_rows, take_csr
from madp.core.selection import (
    BoundOptions,
    alternate_runs,
    record_distribution_stats,
    selection_shards,
    user_distribution_stats,
)

NO_USERS = np.zeros(0, np.int64)


def round_stat(iteration: int, what: str) -> str:
    """The name of a per-iteration count (iteration 0: the build and the first saturation)."""
    return f"round_{iteration:05d}_{what}"


def contribution_stats(contribution: np.ndarray) -> dict[str, int]:
    """The final contributions of users leaving the state, for the report's histogram and maximum
    (none where no user leaves)."""
    if not len(contribution):
        return {}
    return {
        "max_user_contribution": int(contribution.max()),
        **user_distribution_stats(NO_USERS, contribution),
    }


def narrowed(values: np.ndarray) -> np.ndarray:
    """Integers in the narrowest dtype that holds them all (int8 ... int64, or unsigned where none is
    negative): what travels is smaller, and the receiver casts back."""
    if not len(values):
        return values.astype(np.uint8)
    dtype = np.result_type(np.min_scalar_type(values.min()), np.min_scalar_type(values.max()))
    # a negative and a value above int64's half give float64: keep those as they are
    return values.astype(dtype) if dtype.kind in "iu" and dtype.itemsize < values.dtype.itemsize else values


class NarrowedWhenPickled(Columnar):
    """A dataclass of arrays whose integer arrays named in `WORKING_DTYPES` travel `narrowed` (a runner
    pickles the elements it has no coder for) and are cast back to those dtypes on arrival."""

    WORKING_DTYPES: typing.ClassVar[dict[str, type]] = {}

    def __getstate__(self) -> dict:
        narrow = self.WORKING_DTYPES
        return {name: narrowed(value) if name in narrow else value for name, value in vars(self).items()}

    def __setstate__(self, state: dict) -> None:
        vars(self).update({name: state[name].astype(dtype) for name, dtype in self.WORKING_DTYPES.items()})
        vars(self).update({name: value for name, value in state.items() if name not in self.WORKING_DTYPES})


@dataclasses.dataclass
class UserPartition(Columnar):
    """A user partition's part of the algorithm: its users' incidences (`side`) and, per record of
    `side.record_keys`, its number of users, its record partition, and (CSR, ascending) the user
    partitions its users are in (to tell them of its death; the lowest one counts it)."""

    part: int
    side: UserSide
    arity: np.ndarray
    record_partition: np.ndarray
    peer_offsets: np.ndarray
    peers: np.ndarray

    def __getstate__(self) -> dict:
        """The compact form the runner carries (a runner pickles elements it has no coder for): what the
        kernels derive again is left out (each incidence's user, from the users' incidence counts),
        every integer array takes the narrowest dtype that holds its values (`narrowed`: a key,
        count, arity or partition number is often one or two bytes), flags 1 bit."""
        side = self.side
        return {
            "part": self.part,
            "user_incidences": narrowed(np.diff(np.append(side.first_incidence, len(side.inc_user)))),
            "inc_record": narrowed(side.inc_record),
            "record_keys": narrowed(side.record_keys),
            "residual": narrowed(side.residual),
            "capacity": narrowed(side.capacity),
            "eligible": np.packbits(side.eligible),
            "arity": narrowed(self.arity),
            "record_partition": narrowed(self.record_partition),
            "peer_counts": narrowed(np.diff(self.peer_offsets)),
            "peers": narrowed(self.peers),
        }

    def packed(self) -> bytes:
        """The compact form as one bytes value, as partitions travel between steps: a runner groups
        bytes without decoding them, where it would unpickle and pickle an object at every grouping."""
        return pickle.dumps(self.__getstate__(), protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def unpacked(data: bytes) -> UserPartition:
        partition = UserPartition.__new__(UserPartition)
        partition.__setstate__(pickle.loads(data))
        return partition

    def __setstate__(self, state: dict) -> None:
        """The working dtypes back: int64 for the kernels' arrays, int32 for the routing columns."""
        counts = state["user_incidences"].astype(np.int64)
        first_incidence = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        incidences = int(counts.sum())
        self.part = state["part"]
        self.side = UserSide(
            inc_user=np.repeat(np.arange(len(counts), dtype=np.int64), counts),
            inc_record=state["inc_record"].astype(np.int64),
            record_keys=state["record_keys"].astype(np.int64),
            first_incidence=first_incidence,
            residual=state["residual"].astype(np.int64),
            capacity=state["capacity"].astype(np.int64),
            eligible=np.unpackbits(state["eligible"], count=incidences).astype(bool),
        )
        self.arity = state["arity"].astype(np.int32)
        self.record_partition = state["record_partition"].astype(np.int32)
        self.peer_offsets = np.concatenate([[0], np.cumsum(state["peer_counts"], dtype=np.int64)]).astype(np.int64)
        self.peers = state["peers"].astype(np.int32)

    @property
    def incidences(self) -> int:
        """The incidences it holds: the undecided ones once compacted (the "active" count)."""
        return len(self.side.inc_record)

    def owned(self) -> np.ndarray:
        """Per record, whether this is the lowest user partition among its users'."""
        return self.peers[self.peer_offsets[:-1]] == self.part

    def undecided(self) -> np.ndarray:
        """Per record, whether it is still eligible (after a retire step, all of a record's incidences agree)."""
        return np.bincount(self.side.inc_record[self.side.eligible], minlength=len(self.arity)) > 0

    def compacted(self, keep: np.ndarray) -> tuple[UserPartition, np.ndarray]:
        """Only the incidences `keep` marks; (the partition, the final contributions of the users dropped)."""
        side, records, users = compact(self.side, keep)
        offsets, peers = take_csr(self.peer_offsets, self.peers, np.flatnonzero(records))
        partition = UserPartition(self.part, side, self.arity[records], self.record_partition[records], offsets, peers)
        return partition, self.side.contribution[~users]


@dataclasses.dataclass
class RecordPartition(NarrowedWhenPickled):
    """A record partition's records (keys sorted) and the selection of earlier pipeline runs."""

    part: int
    keys: np.ndarray
    ids: pa.Array
    arity: np.ndarray
    copies: np.ndarray  # selected so far
    in_pass: np.ndarray  # selected in the pass in progress

    WORKING_DTYPES: typing.ClassVar[dict[str, type]] = {"keys": np.int64, "arity": np.int64, "copies": np.int64}


@dataclasses.dataclass
class Incidences(Columnar):
    """A record partition's incidences bound for one user partition: per incidence its user and
    record (an index into the per-record arrays), per record what the user partition keeps.

    Its integer arrays stay `narrowed` in memory, not only on the wire: a user partition's worker
    holds every batch sent to it (160 per user partition at 10M records) until it builds the
    partition, and narrow arrays take about half the bytes (4.9 MB instead of 8.9 per record
    partition of the skewed 10M graph). `build_user_partition` casts each field to its
    `WORKING_DTYPES` entry as it concatenates the batches."""

    users: pa.Array
    record: np.ndarray
    record_keys: np.ndarray
    arity: np.ndarray
    primary: np.ndarray
    tie: np.ndarray
    record_partition: int
    peer_offsets: np.ndarray  # CSR per record: the distinct user partitions of its users, ascending
    peers: np.ndarray
    copies: np.ndarray
    in_pass: np.ndarray
    dropped_users: pa.Array  # the distinct users of the incidences the certificate dropped here,
    dropped_counts: np.ndarray  # and how many each: they count in the input's statistics only

    WORKING_DTYPES: typing.ClassVar[dict[str, type]] = {
        "record": np.int64,
        "record_keys": np.int64,
        "arity": np.int32,
        "peer_offsets": np.int64,
        "peers": np.int32,
        "copies": np.int64,
        "dropped_counts": np.int64,
    }

    def __post_init__(self) -> None:
        for name in self.WORKING_DTYPES:
            setattr(self, name, narrowed(getattr(self, name)))

    @property
    def nbytes(self) -> int:
        """The bytes of the arrays that travel."""
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, (np.ndarray, pa.Array)))


class Progress(typing.NamedTuple):
    """The algorithm after an iteration: its control, and whether the state goes to one worker
    (`finish_locally`: few incidences are left), or went there already (`handed_over`)."""

    control: Control
    finish_locally: bool = False
    handed_over: bool = False

    def advanced(self, selected: int, eligible: int, active: int, threshold: int, step_done: bool) -> Progress:
        if self.handed_over or self.finish_locally:
            return self.handed_on()  # the partitions went to the local finish: nothing changes any more
        step_done = step_done and self.control.next != DONE  # an iteration after the end does nothing
        control = self.control.after(selected, eligible) if step_done else self.control
        return Progress(control, finish_locally=control.next != DONE and active <= threshold)

    def handed_on(self) -> Progress:
        """After the step that hands the partitions to the local finish where it is due: handed over."""
        return self._replace(handed_over=True, finish_locally=False) if self.finish_locally else self

    @property
    def selects(self) -> bool:
        """Whether this iteration's record partitions select: a round, with the state still in the partitions."""
        return self.control.next == ROUND and not (self.finish_locally or self.handed_over)


class IterationCounts(typing.NamedTuple):
    """What the partitions counted in an iteration, summed by name: the records it selected, the
    records still eligible and the undecided incidences left (0 where none counted)."""

    selected: int = 0
    eligible: int = 0
    active: int = 0


class SelectedKeys(typing.NamedTuple):
    """Records of one record partition selected in a round (keys), and the pass of that round."""

    keys: np.ndarray
    pass_: int


class ProposalBatch(typing.NamedTuple):
    """A user partition's proposals to one record partition: per record, its key, how many of its users
    in that user partition propose it, and its arity (the integers `narrowed`)."""

    user_partition: int
    record_keys: np.ndarray
    proposers: np.ndarray
    arity: np.ndarray

    @property
    def nbytes(self) -> int:
        """The bytes of the arrays that travel."""
        return self.record_keys.nbytes + self.proposers.nbytes + self.arity.nbytes


class Proposed(typing.NamedTuple):
    """A user partition's proposals, as (record partition, batch), and the bytes of their arrays."""

    batches: list[tuple[int, ProposalBatch]]
    message_bytes: int


def propose_to_record_partitions(state: UserPartition) -> Proposed:
    """Alg. 1 line 7 on a user partition: its users propose their top `residual` eligible records
    (`bounding.propose`), counted per record and sent to each record's partition with its arity, so
    that the record side keeps no state. The state is not changed."""
    counts = np.bincount(state.side.inc_record[propose(state.side)], minlength=len(state.arity))
    records = np.flatnonzero(counts)
    batches = [
        (
            record_part,
            ProposalBatch(
                state.part, state.side.record_keys[index], narrowed(counts[index]), narrowed(state.arity[index])
            ),
        )
        for record_part, index in split_by_partition(records, state.record_partition[records])
    ]
    return Proposed(batches, sum(batch.nbytes for _, batch in batches))


class Selection(typing.NamedTuple):
    """A record partition's selection in a round: the keys selected (ascending) and, per user partition
    that proposed some of them, those keys (`accepted`); the bytes of the accepted keys."""

    selected: np.ndarray
    accepted: list[tuple[int, np.ndarray]]
    message_bytes: int


def select_unanimous(batches: list[ProposalBatch]) -> Selection:
    """Alg. 1 line 8 on a record partition: the records that all their users proposed, summed over
    the user partitions' batches (`bounding.unanimous` with per-batch proposer counts), in whatever
    order the runner delivered the batches."""
    batches = sorted(batches, key=lambda batch: batch.user_partition)
    sources = np.concatenate([np.full(len(batch.record_keys), batch.user_partition, np.int64) for batch in batches])
    keys, proposers, arity = (
        np.concatenate([getattr(batch, field) for batch in batches]) for field in ("record_keys", "proposers", "arity")
    )
    distinct, inverse = np.unique(keys, return_inverse=True)
    users_of = np.zeros(len(distinct), np.int64)
    users_of[inverse] = arity
    selected = unanimous(inverse, users_of, proposers)
    accepted = selected[inverse]
    by_user_partition = list(split_by_partition(keys[accepted], sources[accepted]))
    return Selection(distinct[selected], by_user_partition, sum(keys.nbytes for _, keys in by_user_partition))


class Consumed(typing.NamedTuple):
    """What a user partition's consume step retired: a mask over its records (`dead`), and their keys
    per other user partition holding an incidence of them (`dead_elsewhere`), with their bytes."""

    dead: np.ndarray
    dead_elsewhere: list[tuple[int, np.ndarray]]
    message_bytes: int


def consume_in_partition(state: UserPartition, accepted: np.ndarray, pass_start: bool, certify: bool) -> Consumed:
    """Alg. 1 lines 9-13 on a user partition, in place (`bounding.consume_and_retire`, the local
    engine's step): its users take the `accepted` record keys (at a pass start, after making every
    record of the pass eligible again), and the records its saturated users kill (with `certify`,
    also those the saturation certificate rejects) are retired here and sent to their co-owners'
    user partitions."""
    side = state.side
    dead = consume_and_retire(side, local_mask(side.record_keys, accepted), state.arity, pass_start, certify)
    rows, positions = csr_rows(state.peer_offsets, np.flatnonzero(dead))
    peers = state.peers[positions]
    elsewhere = peers != state.part
    dead_elsewhere = list(split_by_partition(side.record_keys[rows[elsewhere]], peers[elsewhere]))
    return Consumed(dead, dead_elsewhere, sum(keys.nbytes for _, keys in dead_elsewhere))


class Retired(typing.NamedTuple):
    """A user partition after a step: compacted (`state`), the undecided records it owns (`eligible`,
    counted once over the partitions) and the final contributions of the users it dropped."""

    state: UserPartition
    eligible: int
    departed_contributions: np.ndarray

    @property
    def stays(self) -> bool:
        """Whether users are left in it."""
        return bool(len(self.state.side.residual))


def retire_in_partition(
    state: UserPartition, dead: np.ndarray, dead_elsewhere: np.ndarray, duplicates: bool
) -> Retired:
    """Alg. 1 line 13 for the co-owners: a user partition retires the record keys that saturation
    killed in other user partitions (besides its own `dead` mask), counts the eligible records it owns,
    and keeps only what can still change: with duplicates, every record not dead (a later pass of
    Alg. 3 may select it again); without, the eligible incidences. `state` is retired in place and
    left as it was otherwise; the partition that goes on is the compacted one returned."""
    remote = local_mask(state.side.record_keys, dead_elsewhere)
    retire(state.side, remote)
    dead = dead | remote
    eligible = int((state.undecided() & state.owned()).sum())
    keep = ~dead[state.side.inc_record] if duplicates else state.side.eligible.copy()
    compacted, gone = state.compacted(keep)
    return Retired(compacted, eligible, gone)


class FinishedLocally(typing.NamedTuple):
    """The end of the rounds on one worker: the records selected in each round, as (record partition,
    SelectedKeys), the final control, the incidences it started from and the users' contributions."""

    selected: list[tuple[int, SelectedKeys]]
    control: Control
    incidences: int
    contribution: np.ndarray


def finish_locally(states: list[UserPartition], control: Control) -> FinishedLocally:
    """Alg. 1 (and Alg. 3's passes) to the end on the user partitions left, merged into one side: the
    local engine's loop (`bounding.run_steps`), from the `control` they were handed over with."""
    states = sorted(states, key=lambda state: state.part)
    side, positions = merge_sides([state.side for state in states] or [_empty_side()])
    arity = np.zeros(len(side.record_keys), np.int64)
    record_partition = np.zeros(len(side.record_keys), np.int64)
    for state, where in zip(states, positions):
        arity[where], record_partition[where] = state.arity, state.record_partition
    undecided = np.bincount(side.inc_record[side.eligible], minlength=len(arity)) > 0
    selections: list[np.ndarray] = []
    final = run_steps(
        side, arity, undecided, control, lambda selected: selections.append(np.flatnonzero(selected)), log_rounds=False
    )
    rounds_before = len(control.per_round)
    selected = [
        (record_part, SelectedKeys(keys, final.per_round[rounds_before + index].pass_))
        for index, records in enumerate(selections)
        for record_part, keys in split_by_partition(side.record_keys[records], record_partition[records])
    ]
    return FinishedLocally(selected, final, len(side.inc_record), side.contribution)


def _empty_side() -> UserSide:
    empty = np.zeros(0, np.int64)
    return UserSide(empty, empty, empty, empty, empty, empty, np.zeros(0, bool))


class RecordPartitionSplit(typing.NamedTuple):
    """A record partition built (`records`), the records the saturation certificate dropped from it
    (None with duplicates, where it checks none), and its other incidences as (user partition, batch)."""

    records: RecordPartition
    certified_dropped: int | None
    incidences: list[tuple[int, Incidences]]


def split_record_partition(
    part: int,
    chunk: rec.RecordChunk,
    selection: tuple[np.ndarray, np.ndarray],
    options: BoundOptions,
    partitions: int,
    capacities: Capacities,
) -> RecordPartitionSplit:
    """The record side of Alg. 1 built on record partition `part` from its records (`chunk`, whole records in key
    order, its duplicated ids rejected; `selection` the copies and in-pass flags so far): its records
    placed in the universal preference order (`bounding.preference_keys`); without duplicates, the
    records the saturation certificate rejects on this partition alone dropped
    (`bounding.certified_records`); each other incidence sent to its user's partition, with what the
    user partition keeps per record. Of the dropped incidences only each user's count travels, for
    the input's statistics."""
    n, arity = len(chunk), chunk.arity
    copies, in_pass = selection
    records = RecordPartition(part, chunk.keys, chunk.ids, arity, copies, in_pass)
    primary, tie = preference_keys(
        chunk.ids, arity, options.order, options.seed, chunk.weights, alternate_runs(options)
    )
    record_of_incidence = np.repeat(np.arange(n, dtype=np.int32 if n < 2**31 else np.int64), arity)
    dropped = np.zeros(n, dtype=bool)
    if not options.duplicates:
        dropped = _certified(chunk, record_of_incidence, (primary, tie), capacities)
    user_partition = partition_of(chunk.users, partitions) if len(chunk.users) else NO_USERS
    peer_offsets, peers = distinct_partitions(arity, user_partition, partitions)
    batches = []
    sent = ~dropped[record_of_incidence]
    for user_part, here in split_rows(user_partition):
        sent_here = sent[here]
        mine = here[sent_here]
        kept, record = np.unique(record_of_incidence[mine], return_inverse=True)
        offsets, their_peers = take_csr(peer_offsets, peers, kept)
        counted = pc.value_counts(chunk.users.take(pa.array(here[~sent_here]))).flatten()
        incidences = Incidences(
            users=chunk.users.take(pa.array(mine)),
            record=record,
            record_keys=chunk.keys[kept],
            arity=arity[kept],
            primary=primary[kept],
            tie=tie[kept],
            record_partition=part,
            peer_offsets=offsets,
            peers=their_peers,
            copies=copies[kept],
            in_pass=in_pass[kept],
            dropped_users=counted[0],
            dropped_counts=counted[1].to_numpy(),
        )
        batches.append((user_part, incidences))
    return RecordPartitionSplit(records, None if options.duplicates else int(dropped.sum()), batches)


def _certified(
    chunk: rec.RecordChunk,
    record_of_incidence: np.ndarray,
    order: tuple[np.ndarray, np.ndarray],
    capacities: Capacities,
) -> np.ndarray:
    """The records of a record partition that the saturation certificate rejects."""
    if not len(chunk.users):
        return np.zeros(len(chunk), dtype=bool)
    codes, distinct = dense_codes(chunk.users)
    rank = np.empty(len(chunk), np.int64)
    rank[preference_rank_order(*order, chunk.keys)] = np.arange(len(chunk))
    return certified_records(codes, record_of_incidence, rank, chunk.arity, capacities.lookup(distinct))


class BuiltRecordPartition(typing.NamedTuple):
    """A record partition built from its input chunks (`build_record_partition`): the split
    (`split_record_partition`), the duplicated ids rejected, and its counts by name: `counted`, the
    figures an engine may also keep as counters, and `distribution`, the graph digest's parts
    (summed over partitions like the counts, but no count of anything)."""

    split: RecordPartitionSplit
    rejects: rec.Rejects
    counted: dict[str, int]
    distribution: dict[str, int]


def build_record_partition(
    part: int,
    chunks: typing.Iterable[rec.RecordChunk],
    options: BoundOptions,
    partitions: int,
    capacities: Capacities,
    saved_selection: typing.Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
) -> BuiltRecordPartition:
    """Record partition `part` from its records' input chunks (in any order): merged in key order, its
    duplicated ids rejected, the bounded graph's digest taken, and split (`split_record_partition`)
    from the selection so far, `saved_selection(keys)` where an earlier run left one (else none)."""
    rejects = rec.Rejects()
    chunk = rec.merged_records(chunks, rejects)
    counted = {f"rejected_{rec.DUPLICATE_ID}": len(rejects)} if len(rejects) else {}
    counted["input_records"] = len(chunk)
    distribution = graph_digest(chunk.ids, chunk.offsets, chunk.users).to_counts()
    selection = np.zeros(len(chunk), dtype=np.int64), np.zeros(len(chunk), dtype=bool)
    if saved_selection is not None:
        selection = saved_selection(chunk.keys)
    split = split_record_partition(part, chunk, selection, options, partitions, capacities)
    if split.certified_dropped is not None:
        counted["certified_dropped_records"] = split.certified_dropped
    if split.incidences:
        counted[round_stat(0, "shuffled_bytes")] = sum(incidences.nbytes for _, incidences in split.incidences)
    return BuiltRecordPartition(split, rejects, counted, distribution)


def capacities_by_partition(capacities: Capacities, partitions: int) -> typing.Iterator[tuple[int, Capacities]]:
    """Each capacity to the user partition of every user id it can match: its own typed id, or for a
    CSV text id both the string and (if it writes one canonically) the integer; the partition matches
    it to its users exactly (`Capacities.typed_as`)."""
    user_ids, values = capacities.listed
    routes = [user_ids]
    if capacities.text_ids:
        routes.append(capacities.typed_as(pa.int64()))
    mine = np.zeros((partitions, len(values)), dtype=np.bool_)
    for ids in routes:
        valid = ~ids.is_null().to_numpy(zero_copy_only=False)
        partition = partition_of(ids.filter(pa.array(valid)), partitions)
        mine[partition, np.flatnonzero(valid)] = True
    for part in range(partitions):
        yield (
            part,
            Capacities(
                capacities.default,
                user_ids.filter(pa.array(mine[part])),
                values[mine[part]],
                capacities.text_ids,
            ),
        )


class BuiltUserPartition(typing.NamedTuple):
    """A user partition built from its incidences: the partition (None where the certificate dropped
    every incidence sent to it), its users in the input and their records-per-user histogram counts
    (`selection.user_distribution_stats`: users with no incidence left count as selecting none)."""

    state: UserPartition | None
    input_users: int
    input_stats: dict[str, int]

    def counted(self, packed_bytes: int) -> dict[str, int]:
        """Its counts by name, the partition packed into `packed_bytes` (the largest element of the
        rounds' state is the report's `max_user_partition_bytes`)."""
        if self.state is None:
            return {"input_users": self.input_users}
        return {
            "input_users": self.input_users,
            "built_incidences": self.state.incidences,
            "max_user_partition_bytes": packed_bytes,
        }


def build_user_partition(part: int, batches: list[Incidences], capacities: Capacities) -> BuiltUserPartition:
    """The user side of Alg. 1 built on one user partition from the incidences its record partitions
    sent (each record comes from one): its users' incidences sorted by (user, preference), their
    capacities matched, the state of the selection so far derived (`bounding.build_user_side`), and
    per record its arity, record partition and co-owning user partitions."""
    degree, gone = _input_degrees(batches)
    stats = user_distribution_stats(degree, np.zeros(gone, np.int64))
    if not sum(len(batch.users) for batch in batches):
        return BuiltUserPartition(None, len(degree), stats)
    return BuiltUserPartition(_user_partition(part, batches, capacities), len(degree), stats)


def _user_partition(part: int, batches: list[Incidences], capacities: Capacities) -> UserPartition:
    batches = sorted(batches, key=lambda b: b.record_partition)  # whatever order the runner delivered them in
    record_keys = _concatenated(batches, "record_keys")
    order = np.argsort(record_keys)
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    base = np.cumsum([0] + [len(b.record_keys) for b in batches[:-1]])
    per_record = lambda field: _concatenated(batches, field)[order]  # noqa: E731
    side = build_user_side(
        pa.concat_arrays([b.users for b in batches]),
        rank[np.concatenate([b.record.astype(np.int64) + start for b, start in zip(batches, base)])],
        record_keys[order],
        (per_record("primary"), per_record("tie")),
        capacities,
        per_record("copies"),
        per_record("in_pass"),
    )
    record_partition = np.concatenate([np.full(len(b.record_keys), b.record_partition, np.int32) for b in batches])
    peer_offsets, peers = take_csr(*_concat_csr(batches), order)
    return UserPartition(part, side, per_record("arity"), record_partition[order], peer_offsets, peers)


def _concatenated(batches: list[Incidences], field: str) -> np.ndarray:
    """One field of every batch, end to end, in its working dtype."""
    return np.concatenate([getattr(b, field) for b in batches], dtype=Incidences.WORKING_DTYPES.get(field))


def _concat_csr(batches: list[Incidences]) -> tuple[np.ndarray, np.ndarray]:
    base = np.cumsum([0] + [len(b.peers) for b in batches[:-1]])
    offsets = [b.peer_offsets[1:].astype(np.int64) + start for b, start in zip(batches, base)]
    return np.concatenate([[0], *offsets], dtype=np.int64), _concatenated(batches, "peers")


def _input_degrees(batches: list[Incidences]) -> tuple[np.ndarray, int]:
    """(records per user in the input, users with no incidence left after the certificate) of the
    users of these batches: the incidences sent and the counts of those dropped."""
    sent = sum(len(b.users) for b in batches)
    codes, distinct = dense_codes(pa.concat_arrays([b.users for b in batches] + [b.dropped_users for b in batches]))
    degree = np.bincount(codes[:sent], minlength=len(distinct))
    users_sent = int(np.count_nonzero(degree))
    dropped = np.concatenate([b.dropped_counts for b in batches], dtype=np.int64)
    degree += np.bincount(codes[sent:], weights=dropped, minlength=len(distinct)).astype(np.int64)
    return degree, len(degree) - users_sent


class RecordSelection(typing.NamedTuple):
    """A record partition's selection after a pipeline run: copies per record, and whether selected in
    the pass in progress."""

    copies: np.ndarray
    in_pass: np.ndarray


def record_selection(
    records: RecordPartition, selections: list[SelectedKeys], control: Control, passes_at_start: int
) -> RecordSelection:
    """A record partition's copies from the selection it started with and the records selected in each
    round (`selections`); in the pass in progress where `control` is still in the pass the run started in."""
    copies, in_pass = records.copies.copy(), records.in_pass & (control.passes == passes_at_start)
    for keys, pass_ in selections:
        where = np.searchsorted(records.keys, keys)
        copies[where] += 1
        if pass_ == control.passes:
            in_pass[where] = True
    return RecordSelection(copies, in_pass)


class FinishedRecords(typing.NamedTuple):
    """A record partition at the end of a run (`finish_record_partition`): its selection, its counts
    (`counted`: selected copies and distinct records; `distribution`: the records' histograms) and,
    where the algorithm is done, its part of each output shard (empty tables too: they carry the id
    type, so a shard no partition fills is still typed right)."""

    selection: RecordSelection
    counted: dict[str, int]
    distribution: dict[str, int]
    shards: dict[int, pa.Table]


def finish_record_partition(
    records: RecordPartition, selections: list[SelectedKeys], control: Control, passes_at_start: int, shards: int
) -> FinishedRecords:
    """A record partition's selection from every round's (`record_selection`), counted, and split into
    the `shards` output shards once `control` is done."""
    selection = record_selection(records, selections, control, passes_at_start)
    copies = selection.copies
    counted = {"selected_records": int(copies.sum()), "distinct_selected": int((copies > 0).sum())}
    parts: dict[int, pa.Table] = {}
    if control.next == DONE:
        selected = copies > 0
        parts = selection_shards(records.ids.filter(pa.array(selected)), copies[selected], shards)
    return FinishedRecords(selection, counted, record_distribution_stats(records.arity, copies), parts)
