"""The steps of Alg. 1 on user partitions, as Beam transforms: each user partition's state travels
through the graph as one element, and only what can still change travels on.

  iteration i:  users --proposals--> records --accepted--> users --dead--> co-owners' user partitions

A user partition (`UserPartition`) holds its users' incidences in preference order and, per record,
what routing needs. The record side keeps no state during the rounds: a proposal carries the record's
arity, so a record partition only counts proposals. After each iteration, every partition drops the
incidences of decided records (selected, or dead because a user saturated) and the users left with
none (`UserPartition.compacted`), so the state of later rounds holds only undecided incidences.

One `Progress` value per iteration (a singleton PCollection, side input of the next iteration) carries
the shared control flow (`bounding.Control`) and decides when what is left is small enough for one
worker: from there the local kernels finish it in one keyed step (`FinishLocally`).
"""

from __future__ import annotations

import dataclasses
import pickle
import typing
from typing import Any

import apache_beam as beam
import numpy as np

from madp.beam.pipeline import by_kind, stat
from madp.core.bounding import (
    DONE,
    ROUND,
    START_PASS,
    Control,
    UserSide,
    certified_rejections,
    compact,
    consume,
    local_mask,
    merge_sides,
    propose,
    retire,
    run_steps,
)
from madp.core.columnar import Columnar
from madp.core.routing import csr_rows, split_by_partition, take_csr
from madp.core.selection import user_distribution_stats

STATE, ACCEPTED, DEAD, PROGRESS = "state", "accepted", "dead", "progress"
NO_USERS = np.zeros(0, np.int64)


def narrowed(values: np.ndarray) -> np.ndarray:
    """Integers in the narrowest dtype that holds them all (int8 ... int64, or unsigned where none is
    negative): what travels is smaller, and the receiver casts back."""
    if not len(values):
        return values.astype(np.uint8)
    dtype = np.result_type(np.min_scalar_type(values.min()), np.min_scalar_type(values.max()))
    # a negative and a value above int64's half give float64: keep those as they are
    return values.astype(dtype) if dtype.kind in "iu" and dtype.itemsize < values.dtype.itemsize else values


class NarrowedWhenPickled(Columnar):
    """A dataclass of arrays whose integer arrays named in `WORKING_DTYPES` travel `narrowed` (Beam
    pickles the elements it has no coder for) and are cast back to those dtypes on arrival."""

    WORKING_DTYPES: typing.ClassVar[dict[str, type]] = {}

    def __getstate__(self) -> dict:
        narrow = self.WORKING_DTYPES
        return {name: narrowed(value) if name in narrow else value for name, value in vars(self).items()}

    def __setstate__(self, state: dict) -> None:
        vars(self).update({name: state[name].astype(dtype) for name, dtype in self.WORKING_DTYPES.items()})
        vars(self).update({name: value for name, value in state.items() if name not in self.WORKING_DTYPES})


def round_stat(iteration: int, what: str) -> str:
    return f"round_{iteration:05d}_{what}"


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
        """The compact form the runner carries (Beam pickles elements it has no coder for): what the
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


class Progress(typing.NamedTuple):
    """The algorithm after an iteration: its control, and whether the state goes to one worker
    (`finish_locally`: few incidences are left), or went there already (`handed_over`)."""

    control: Control
    finish_locally: bool = False
    handed_over: bool = False

    def advanced(self, selected: int, eligible: int, active: int, threshold: int, step_done: bool) -> Progress:
        if self.handed_over or self.finish_locally:
            return self._replace(handed_over=True, finish_locally=False)
        step_done = step_done and self.control.next != DONE  # an iteration after the end does nothing
        control = self.control.after(selected, eligible) if step_done else self.control
        return Progress(control, finish_locally=control.next != DONE and active <= threshold)


def _contribution_stats(contribution: np.ndarray):
    """The final contributions of users leaving the state, for the report's histogram and maximum."""
    if len(contribution):
        yield stat("max_user_contribution", int(contribution.max()))
        for name, value in user_distribution_stats(NO_USERS, contribution).items():
            yield beam.pvalue.TaggedOutput("stats", (name, value))


def _departure(state: UserPartition, progress: Progress) -> list | None:
    """What a user partition emits when the last progress takes it out of the rounds (when done: its
    users' final contributions; when little is left: itself, to the local finish); None if it stays."""
    if progress.control.next == DONE:
        return list(_contribution_stats(state.side.contribution))
    if progress.finish_locally:
        return [beam.pvalue.TaggedOutput("finish", (0, (STATE, state.packed())))]
    return None


def _send(tag: str, destination: int, payload) -> beam.pvalue.TaggedOutput:
    """A message to a partition, tagged with its kind for the join at the destination."""
    return beam.pvalue.TaggedOutput(tag, (destination, (tag, payload)))


@beam.typehints.with_output_types(tuple[int, Any])
class _Propose(beam.DoFn):
    """A user partition's users propose their top eligible records, each to its record partition
    with its arity. No side input, so that the runner fuses this step with the one before: a pass
    start or the end has nothing eligible, and the selection ignores proposals it does not need."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    def process(self, element):
        part, state = element[0], UserPartition.unpacked(element[1])
        counts = np.bincount(state.side.inc_record[propose(state.side)], minlength=len(state.arity))
        records = np.flatnonzero(counts)
        shuffled = len(element[1])  # the packed partition, on to the join with its acceptances
        for record_part, index in split_by_partition(records, state.record_partition[records]):
            message = (part, state.side.record_keys[index], narrowed(counts[index]), narrowed(state.arity[index]))
            shuffled += sum(a.nbytes for a in message[1:])
            yield beam.pvalue.TaggedOutput("proposals", (record_part, message))
        yield stat(round_stat(self.iteration, "shuffled_bytes"), shuffled)
        yield part, (STATE, element[1])


@beam.typehints.with_output_types(tuple[int, Any])
class _Select(beam.DoFn):
    """A record partition: in a round, the records every user proposed (their arity's worth) are
    selected; tell the user partitions that proposed them."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    def process(self, element, progress: Progress):
        record_part, messages = element
        if progress.control.next == ROUND and not (progress.finish_locally or progress.handed_over):
            yield from self._select(record_part, messages, progress)

    def _select(self, record_part: int, messages, progress: Progress):
        messages = sorted(messages, key=lambda m: m[0])  # whatever order the runner delivered them in
        sources = np.concatenate([np.full(len(m[1]), m[0], np.int64) for m in messages])
        keys, counts, arity = (np.concatenate([m[i] for m in messages]) for i in (1, 2, 3))
        distinct, inverse = np.unique(keys, return_inverse=True)
        proposed_by = np.bincount(inverse, weights=counts, minlength=len(distinct)).astype(np.int64)
        users_of = np.zeros(len(distinct), np.int64)
        users_of[inverse] = arity
        unanimous_records = proposed_by == users_of
        selected, accepted = distinct[unanimous_records], unanimous_records[inverse]
        yield stat(round_stat(self.iteration, "selected"), len(selected))
        yield beam.pvalue.TaggedOutput("counts", ("selected", len(selected)))
        if len(selected):
            yield beam.pvalue.TaggedOutput("selected", (record_part, (selected, progress.control.passes)))
        shuffled = 0
        for user_part, keys_there in split_by_partition(keys[accepted], sources[accepted]):
            shuffled += keys_there.nbytes
            yield _send(ACCEPTED, user_part, keys_there)
        yield stat(round_stat(self.iteration, "shuffled_bytes"), shuffled)


def _messages(grouped: dict, tag: str) -> np.ndarray:
    return np.concatenate(grouped[tag]) if tag in grouped else np.zeros(0, np.int64)


@beam.typehints.with_output_types(tuple[int, Any])
class _Consume(beam.DoFn):
    """A user partition, by the last progress: when done, it leaves (its users' contributions are
    final); when what is left is small, it goes to the local finish; else it takes its accepted
    records (at a pass start, after making every record of the pass eligible again), and the records
    its saturated users kill are retired here and, by message, in the co-owners' user partitions."""

    def __init__(self, iteration: int, certify: bool = False):
        self.iteration, self.certify = iteration, certify

    def process(self, element, progress: Progress):
        part, values = element
        grouped = by_kind(values)
        if STATE in grouped:  # messages go to partitions that exist (a proposer or a co-owner stays till told)
            state = UserPartition.unpacked(grouped[STATE][0])
            departure = _departure(state, progress)
            yield from self._consume(part, state, grouped, progress) if departure is None else departure

    def _consume(self, part: int, state: UserPartition, grouped: dict, progress: Progress):
        side = state.side
        if progress.control.next == START_PASS:
            side.eligible[:] = True
        dead = consume(side, local_mask(side.record_keys, _messages(grouped, ACCEPTED)))
        if self.certify:
            dead |= certified_rejections(side, state.arity)
        retire(side, dead)
        rows, positions = csr_rows(state.peer_offsets, np.flatnonzero(dead))
        peers = state.peers[positions]
        elsewhere = peers != part
        shuffled = 0
        for user_part, keys in split_by_partition(side.record_keys[rows[elsewhere]], peers[elsewhere]):
            shuffled += keys.nbytes
            yield _send(DEAD, user_part, keys)
        packed = state.packed()
        yield stat(round_stat(self.iteration, "shuffled_bytes"), shuffled + len(packed))
        yield part, (STATE, (packed, dead))


@beam.typehints.with_output_types(tuple[int, Any])
class _Retire(beam.DoFn):
    """A user partition retires the records saturation killed elsewhere, counts the eligible records
    it owns, and keeps only what can still change: with duplicates, every record not dead (a later
    pass may select it again); without, the eligible incidences."""

    def __init__(self, iteration: int, duplicates: bool):
        self.iteration, self.duplicates = iteration, duplicates

    def process(self, element):
        part, values = element
        grouped = by_kind(values)
        ((packed, dead),) = grouped[STATE]
        state = UserPartition.unpacked(packed)
        remote = local_mask(state.side.record_keys, _messages(grouped, DEAD))
        retire(state.side, remote)
        dead = dead | remote
        eligible = int((state.undecided() & state.owned()).sum())
        yield stat(round_stat(self.iteration, "eligible"), eligible)
        yield beam.pvalue.TaggedOutput("counts", ("eligible", eligible))
        keep = ~dead[state.side.inc_record] if self.duplicates else state.side.eligible.copy()
        state, gone = state.compacted(keep)
        yield from _contribution_stats(gone)
        active = len(state.side.inc_record)
        yield stat(round_stat(self.iteration, "active_incidences"), active)
        yield beam.pvalue.TaggedOutput("counts", ("active", active))
        if len(state.side.residual):
            yield part, state.packed()


class IterationCounts(typing.NamedTuple):
    """What the partitions counted in an iteration (its "counts" outputs), summed by name: the records
    it selected, the records still eligible and the undecided incidences left (0 where none counted)."""

    selected: int = 0
    eligible: int = 0
    active: int = 0


def _advance(counts: IterationCounts, previous: Progress, threshold: int, step_done: bool) -> Progress:
    return previous.advanced(counts.selected, counts.eligible, counts.active, threshold, step_done)


class _Totals(beam.PTransform):
    """(name, count) pairs -> one IterationCounts of their totals by name."""

    def expand(self, pairs):
        return (
            pairs
            | "SumByName" >> beam.CombinePerKey(sum)
            | "AsDict" >> beam.combiners.ToDict()
            | "AsCounts" >> beam.Map(lambda totals: IterationCounts(**totals))
        )


class _RetireDead(beam.PTransform):
    """(consumed partitions, the deaths they sent) -> each partition joined with the deaths sent to it
    and retired: state, counts and stats outputs."""

    def __init__(self, iteration: int, duplicates: bool):
        super().__init__()
        self.iteration, self.duplicates = iteration, duplicates

    def expand(self, consumed_and_dead):
        return (
            consumed_and_dead
            | "MeetDead" >> beam.Flatten()
            | "JoinDead" >> beam.GroupByKey()
            | "Retire"
            >> beam.ParDo(_Retire(self.iteration, self.duplicates)).with_outputs("counts", "stats", main="state")
        )


class Iteration(beam.PTransform):
    """One step of the algorithm on the user partitions: a round (proposals, unanimous selection,
    saturation), or a pass start (saturation only); (user partition, packed UserPartition) and the last
    Progress in; the partitions, the new Progress, the selected records (record partition, (keys,
    pass)) and the partitions handed to the local finish out."""

    def __init__(self, iteration: int, duplicates: bool, threshold: int):
        super().__init__()
        self.iteration, self.duplicates, self.threshold = iteration, duplicates, threshold

    def expand(self, inputs):
        users, progress = inputs
        last = beam.pvalue.AsSingleton(progress)
        # (user partition, (STATE, packed UserPartition));
        # proposals: (record partition, (user partition, keys, counts, arity))
        routed = users | "Propose" >> beam.ParDo(_Propose(self.iteration)).with_outputs(
            "proposals", "stats", main="state"
        )
        # accepted: (user partition, (ACCEPTED, keys)); selected: (record partition, (keys, pass))
        selected = (
            routed.proposals
            | "GroupProposals" >> beam.GroupByKey()
            | "SelectUnanimous"
            >> beam.ParDo(_Select(self.iteration), last).with_outputs(ACCEPTED, "selected", "counts", "stats")
        )
        consumed = (
            (routed.state, selected[ACCEPTED])
            | "MeetAccepted" >> beam.Flatten()
            | "JoinAccepted" >> beam.GroupByKey()
            | "Consume"
            >> beam.ParDo(_Consume(self.iteration), last).with_outputs(DEAD, "finish", "stats", main="state")
        )
        retired = (consumed.state, consumed[DEAD]) | "RetireDead" >> _RetireDead(self.iteration, self.duplicates)
        advanced = (
            (selected.counts, retired.counts)
            | "IterationCounts" >> beam.Flatten()
            | "SumCounts" >> _Totals()
            | "Advance" >> beam.Map(_advance, last, self.threshold, True)
        )
        stats = (routed.stats, selected.stats, consumed.stats, retired.stats) | "IterationStats" >> beam.Flatten()
        return retired.state, advanced, selected.selected, consumed.finish, stats


class FirstSaturation(beam.PTransform):
    """The state as built, (user partition, packed UserPartition), with the build's counts ("eligible",
    "active") and one Progress holding `control` -> the state once the records of users with no
    capacity left, and without duplicates the records the saturation certificate rejects
    (`bounding.certified_rejections`, the same at a pass start and in a later pipeline run), are
    retired everywhere, the Progress after it, and stats. When `control` starts a pass, that is the
    pass start; else the run continues the algorithm where the last one stopped. With duplicates and
    no capacities that can start saturated (`saturate` False: no capacities file, no earlier
    selection), there is nothing to retire and the state goes on as built."""

    def __init__(self, control: Control, threshold: int, saturate: bool):
        super().__init__()
        self.control, self.threshold, self.saturate = control, threshold, saturate

    def expand(self, inputs):
        users, counts, start = inputs
        last = beam.pvalue.AsSingleton(start)
        stats = []
        if self.saturate:
            consumed = (
                users
                | "AsState" >> beam.MapTuple(lambda part, state: (part, [(STATE, state)]))
                | "Consume"
                >> beam.ParDo(_Consume(0, certify=not self.control.duplicates), last).with_outputs(
                    DEAD, "stats", main="state"
                )
            )
            retired = (consumed.state, consumed[DEAD]) | "RetireDead" >> _RetireDead(0, self.control.duplicates)
            users, counts = retired.state, retired.counts
            stats = [consumed.stats, retired.stats]
        progress = (
            counts
            | "SumCounts" >> _Totals()
            | "Advance" >> beam.Map(_advance, last, self.threshold, self.control.next == START_PASS)
        )
        return users, progress, tuple(stats) | "Stats" >> beam.Flatten(pipeline=users.pipeline)


class _Route(beam.DoFn):
    """After the last iteration: a user partition leaves as the last progress says, or stays for the
    next pipeline run (neither done nor small enough for one worker)."""

    def process(self, element, progress: Progress):
        yield from _departure(UserPartition.unpacked(element[1]), progress) or ()


@beam.typehints.with_output_types(tuple[int, Any])
class _FinishLocally(beam.DoFn):
    """The user partitions left, merged into one and bounded to the end by the local kernels, from
    the control they were handed over with; the selected records go to their record partitions."""

    def process(self, element):
        _, values = element
        grouped = by_kind(values)
        (progress,) = grouped[PROGRESS]
        if progress.handed_over:
            yield from self._finish(progress, grouped)
        else:
            yield beam.pvalue.TaggedOutput("control", progress.control)

    def _finish(self, progress: Progress, grouped: dict):
        states = sorted(map(UserPartition.unpacked, grouped.get(STATE, [])), key=lambda state: state.part)
        side, positions = merge_sides([state.side for state in states] or [_empty_side()])
        arity = np.zeros(len(side.record_keys), np.int64)
        record_partition = np.zeros(len(side.record_keys), np.int64)
        for state, where in zip(states, positions):
            arity[where], record_partition[where] = state.arity, state.record_partition
        undecided = np.bincount(side.inc_record[side.eligible], minlength=len(arity)) > 0
        control = progress.control
        selections: list[tuple[np.ndarray, int]] = []
        control = run_steps(
            side,
            arity,
            undecided,
            control,
            lambda selected: selections.append((np.flatnonzero(selected), len(selections))),
            log_rounds=False,
        )
        rounds_before = len(progress.control.per_round)
        for records, index in selections:
            passes = control.per_round[rounds_before + index].pass_
            for record_part, keys in split_by_partition(side.record_keys[records], record_partition[records]):
                yield beam.pvalue.TaggedOutput("selected", (record_part, (keys, passes)))
        yield stat("finished_locally_incidences", len(side.inc_record))
        yield from _contribution_stats(side.contribution)
        yield beam.pvalue.TaggedOutput("control", control)


def _empty_side() -> UserSide:
    empty = np.zeros(0, np.int64)
    return UserSide(empty, empty, empty, empty, empty, empty, np.zeros(0, bool))


class AfterLastRound(beam.PTransform):
    """(user partitions, last Progress) -> the partitions handed to the local finish (0, (STATE, packed
    UserPartition)) and stats."""

    def expand(self, inputs):
        users, progress = inputs
        last = users | "Route" >> beam.ParDo(_Route(), beam.pvalue.AsSingleton(progress)).with_outputs(
            "finish", "stats", main="left"
        )
        return last.finish, last.stats


def _after_last_route(progress: Progress) -> Progress:
    return progress._replace(handed_over=True, finish_locally=False) if progress.finish_locally else progress


class FinishLocally(beam.PTransform):
    """The partitions handed over (0, (STATE, packed UserPartition)) and the last iteration's Progress ->
    the records selected from there (record partition, (keys, pass)), the final Control (one) and stats."""

    def __init__(self, handed: tuple[beam.PCollection, ...]):
        super().__init__()
        self.handed = handed

    def expand(self, progress):
        final = progress | "AfterLastRoute" >> beam.Map(_after_last_route)
        finished = (
            (final | "KeyProgress" >> beam.Map(lambda p: (0, (PROGRESS, p))), *self.handed)
            | "Gather" >> beam.Flatten()
            | "OneWorker" >> beam.GroupByKey()
            | "Finish" >> beam.ParDo(_FinishLocally()).with_outputs("selected", "control", "stats")
        )
        return finished.selected, finished.control, finished.stats
