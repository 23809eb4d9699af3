"""The steps of Alg. 1 on user partitions, as Beam transforms: each user partition's state travels
through the graph as one element, and only what can still change travels on. Each step is a function
of `madp.core.bound_steps` (partition and messages in, partitions, messages and counts out); a DoFn
here unpacks its element, calls the step and emits the result as tagged outputs and counters.

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

from typing import Any

import apache_beam as beam
import numpy as np

from madp.beam.pipeline import stat
from madp.core.bound_steps import (
    IterationCounts,
    Progress,
    SelectedKeys,
    UserPartition,
    consume_in_partition,
    contribution_stats,
    finish_locally,
    propose_to_record_partitions,
    retire_in_partition,
    round_stat,
    select_unanimous,
)
from madp.core.bounding import DONE, START_PASS, Control
from madp.core.routing import by_kind, messages_of

STATE, ACCEPTED, DEAD, PROGRESS = "state", "accepted", "dead", "progress"


def _contribution_stats(contribution: np.ndarray):
    """The final contributions of users leaving the state, for the report's histogram and maximum
    (`bound_steps.contribution_stats`; none a Beam counter)."""
    for name, value in contribution_stats(contribution).items():
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
        proposed = propose_to_record_partitions(UserPartition.unpacked(element[1]))
        for record_part, batch in proposed.batches:
            yield beam.pvalue.TaggedOutput("proposals", (record_part, batch))
        # the packed partition goes on to the join with its acceptances
        yield stat(round_stat(self.iteration, "shuffled_bytes"), len(element[1]) + proposed.message_bytes)
        yield element[0], (STATE, element[1])


@beam.typehints.with_output_types(tuple[int, Any])
class _Select(beam.DoFn):
    """A record partition: in a round, the records every user proposed (their arity's worth) are
    selected; tell the user partitions that proposed them."""

    def __init__(self, iteration: int):
        self.iteration = iteration

    def process(self, element, progress: Progress):
        record_part, batches = element
        if not progress.selects:
            return
        selection = select_unanimous(batches)
        yield stat(round_stat(self.iteration, "selected"), len(selection.selected))
        yield beam.pvalue.TaggedOutput("counts", ("selected", len(selection.selected)))
        if len(selection.selected):
            yield beam.pvalue.TaggedOutput(
                "selected", (record_part, SelectedKeys(selection.selected, progress.control.passes))
            )
        for user_part, keys in selection.accepted:
            yield _send(ACCEPTED, user_part, keys)
        yield stat(round_stat(self.iteration, "shuffled_bytes"), selection.message_bytes)


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
        pass_start = progress.control.next == START_PASS
        consumed = consume_in_partition(state, messages_of(grouped, ACCEPTED), pass_start, self.certify)
        for user_part, keys in consumed.dead_elsewhere:
            yield _send(DEAD, user_part, keys)
        packed = state.packed()
        yield stat(round_stat(self.iteration, "shuffled_bytes"), consumed.message_bytes + len(packed))
        yield part, (STATE, (packed, consumed.dead))


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
        retired = retire_in_partition(UserPartition.unpacked(packed), dead, messages_of(grouped, DEAD), self.duplicates)
        yield stat(round_stat(self.iteration, "eligible"), retired.eligible)
        yield beam.pvalue.TaggedOutput("counts", ("eligible", retired.eligible))
        yield from _contribution_stats(retired.departed_contributions)
        active = retired.state.incidences
        yield stat(round_stat(self.iteration, "active_incidences"), active)
        yield beam.pvalue.TaggedOutput("counts", ("active", active))
        if retired.stays:
            yield part, retired.state.packed()


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
    Progress in; the partitions, the new Progress, the selected records (record partition,
    SelectedKeys) and the partitions handed to the local finish out."""

    def __init__(self, iteration: int, duplicates: bool, threshold: int):
        super().__init__()
        self.iteration, self.duplicates, self.threshold = iteration, duplicates, threshold

    def expand(self, inputs):
        users, progress = inputs
        last = beam.pvalue.AsSingleton(progress)
        # (user partition, (STATE, packed UserPartition)); proposals: (record partition, ProposalBatch)
        routed = users | "Propose" >> beam.ParDo(_Propose(self.iteration)).with_outputs(
            "proposals", "stats", main="state"
        )
        # accepted: (user partition, (ACCEPTED, keys)); selected: (record partition, SelectedKeys)
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
        finished = finish_locally(list(map(UserPartition.unpacked, grouped.get(STATE, []))), progress.control)
        for record_part, selected in finished.selected:
            yield beam.pvalue.TaggedOutput("selected", (record_part, selected))
        yield stat("finished_locally_incidences", finished.incidences)
        yield from _contribution_stats(finished.contribution)
        yield beam.pvalue.TaggedOutput("control", finished.control)


class AfterLastRound(beam.PTransform):
    """(user partitions, last Progress) -> the partitions handed to the local finish (0, (STATE, packed
    UserPartition)) and stats."""

    def expand(self, inputs):
        users, progress = inputs
        last = users | "Route" >> beam.ParDo(_Route(), beam.pvalue.AsSingleton(progress)).with_outputs(
            "finish", "stats", main="left"
        )
        return last.finish, last.stats


class FinishLocally(beam.PTransform):
    """The partitions handed over (0, (STATE, packed UserPartition)) and the last iteration's Progress ->
    the records selected from there (record partition, SelectedKeys), the final Control (one) and stats."""

    def __init__(self, handed: tuple[beam.PCollection, ...]):
        super().__init__()
        self.handed = handed

    def expand(self, progress):
        final = progress | "AfterLastRoute" >> beam.Map(lambda last: last.handed_on())
        finished = (
            (final | "KeyProgress" >> beam.Map(lambda p: (0, (PROGRESS, p))), *self.handed)
            | "Gather" >> beam.Flatten()
            | "OneWorker" >> beam.GroupByKey()
            | "Finish" >> beam.ParDo(_FinishLocally()).with_outputs("selected", "control", "stats")
        )
        return finished.selected, finished.control, finished.stats
