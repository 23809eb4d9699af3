"""One round of Alg. 1 on partitions, as Beam steps: the state of both sides and the messages
between them.

  users --proposals--> records --accepted--> users --dead--> co-owners' user partitions

A partition's state stays in a `SideStore`; its handle travels through the graph, joined at each
step with the messages (record keys) sent to the partition.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import apache_beam as beam
import numpy as np

from beam_pipelines.pipeline import by_kind, stat
from beam_pipelines.store import PartitionStore, read_static
from madp.core.bounding import UserSide, consume, local_mask, propose, retire, unanimous
from madp.core.routing import csr_rows, set_bits, split_by_partition

STATE = "state"


@dataclasses.dataclass(frozen=True)
class RecordState:
    """A record partition's side of the algorithm (keys sorted)."""

    keys: np.ndarray
    arity: np.ndarray
    user_partition_offsets: np.ndarray  # CSR: distinct user partitions of each record
    user_partitions: np.ndarray
    copies: np.ndarray
    in_pass: np.ndarray


_CHANGING = {"users": ("eligible", "residual"), "records": ("copies", "in_pass")}


class SideStore(PartitionStore):
    """Each side's partitions: static arrays written once, the changing ones by each step that
    changes them. A handle is (static path, changing path; for users also a routing path)."""

    def create(self, side: str, part: int, state) -> tuple[str, str]:
        arrays = dataclasses.asdict(state)
        static = {k: v for k, v in arrays.items() if k not in _CHANGING[side]}
        return (self.write_arrays(f"{side}-{part:05d}-static.store", static), self.update(side, part, "built", state))

    def update(self, side: str, part: int, step: str, state) -> str:
        return self.write_arrays(f"{side}-{part:05d}-{step}.store", {k: getattr(state, k) for k in _CHANGING[side]})

    def load(self, side: str, handle: tuple[str, ...]):
        arrays = {**read_static(handle[0]), **self.read_arrays(handle[1])}
        return UserSide(**arrays) if side == "users" else RecordState(**arrays)


def round_stat(round_index: int, what: str) -> str:
    return f"round_{round_index:05d}_{what}"


def send(tag: str, destination: int, keys: np.ndarray) -> beam.pvalue.TaggedOutput:
    """A message to a partition, tagged with its kind for the join at the destination."""
    return beam.pvalue.TaggedOutput(tag, (destination, (tag, keys)))


def keep(part: int, state) -> tuple:
    return part, (STATE, state)


def _messages(grouped: dict, tag: str) -> np.ndarray:
    return np.concatenate(grouped[tag]) if tag in grouped else np.zeros(0, np.int64)


@beam.typehints.with_output_types(tuple[int, Any])
class _Propose(beam.DoFn):
    def __init__(self, store: SideStore):
        self.store = store

    def process(self, element):
        part, (_, handle) = element
        side, routing = self.store.load("users", handle), read_static(handle[2])
        index = side.inc_record[propose(side)]
        for record_part, keys in split_by_partition(side.record_keys[index], routing["record_partition"][index]):
            yield send("proposals", record_part, keys)
        yield element


@beam.typehints.with_output_types(tuple[int, Any])
class _JoinedStep(beam.DoFn):
    """A step of round `round_index`: one partition's state, joined with the messages sent to it."""

    def __init__(self, store: SideStore, round_index: int):
        self.store, self.round_index = store, round_index

    def process(self, element):
        part, grouped = element[0], by_kind(element[1])
        (state,) = grouped.pop(STATE)
        yield from self.step(part, state, grouped)

    def saved(self, side: str, part: int, static: str, state, step: str) -> tuple[str, str]:
        return static, self.store.update(side, part, f"r{self.round_index:05d}-{step}", state)

    def step(self, part: int, state, messages: dict):
        raise NotImplementedError


class _Select(_JoinedStep):
    """Record side: select the records proposed by all their users; tell those users."""

    def step(self, part, handle, messages):
        state = self.store.load("records", handle)
        accepted = unanimous(np.searchsorted(state.keys, _messages(messages, "proposals")), state.arity)
        yield stat(round_stat(self.round_index, "selected"), accepted.sum())
        if accepted.any():
            state = dataclasses.replace(state, copies=state.copies + accepted, in_pass=state.in_pass | accepted)
            handle = self.saved("records", part, handle[0], state, "selected")
            yield from _notify_users(state, accepted, "accepted")
        yield keep(part, handle)


def _notify_users(state: RecordState, records: np.ndarray, tag: str):
    rows, positions = csr_rows(state.user_partition_offsets, np.flatnonzero(records))
    for user_part, keys in split_by_partition(state.keys[rows], state.user_partitions[positions]):
        yield send(tag, user_part, keys)


class _Consume(_JoinedStep):
    """User side: take the accepted records; retire the records its saturated users kill, here and
    (by message) in the co-owners' user partitions."""

    def step(self, part, handle, messages):
        side, routing = self.store.load("users", handle), read_static(handle[2])
        before = side.eligible.sum()
        dead = consume(side, local_mask(side.record_keys, _messages(messages, "accepted")))
        retire(side, dead)
        rows, partitions = set_bits(routing["coowners"][dead])
        elsewhere = partitions != part
        for user_part, keys in split_by_partition(side.record_keys[dead][rows[elsewhere]], partitions[elsewhere]):
            yield send("dead", user_part, keys)
        if side.eligible.sum() != before:
            handle = (*self.saved("users", part, handle[0], side, "consumed"), handle[2])
        yield keep(part, handle)


class _Retire(_JoinedStep):
    """User side: retire the records that saturation killed elsewhere; count the eligible records
    this partition owns (lowest user partition among a record's users)."""

    def step(self, part, handle, messages):
        side, routing = self.store.load("users", handle), read_static(handle[2])
        if "dead" in messages:
            retire(side, local_mask(side.record_keys, _messages(messages, "dead")))
            handle = (*self.saved("users", part, handle[0], side, "retired"), handle[2])
        eligible_records = np.bincount(side.inc_record[side.eligible], minlength=len(side.record_keys)) > 0
        yield stat(round_stat(self.round_index, "eligible"), (eligible_records & routing["owner"]).sum())
        yield keep(part, handle)


class _Step(beam.PTransform):
    """Join a partition's handle with the messages sent to it and apply one step.

    States and messages arrive tagged by their producers, so the join is a Flatten and a
    GroupByKey (a CoGroupByKey would add five transforms per step to a graph of hundreds).
    """

    def __init__(self, step: beam.DoFn, outputs: tuple[str, ...]):
        super().__init__()
        self.step, self.outputs = step, outputs

    def expand(self, inputs):
        return (
            inputs
            | "Meet" >> beam.Flatten()
            | "Join" >> beam.GroupByKey()
            | "Apply" >> beam.ParDo(self.step).with_outputs(*self.outputs, main=STATE)
        )


class Saturate(beam.PTransform):
    """Alg. 1 lines 9-13: users take accepted records; records of saturated users leave E everywhere."""

    def __init__(self, store: SideStore, round_index: int):
        super().__init__()
        self.store, self.round_index = store, round_index

    def expand(self, inputs):
        users, accepted = inputs
        consumed = (users, accepted) | "UsersTakeAccepted" >> _Step(_Consume(self.store, self.round_index), ("dead",))
        retired = (consumed.state, consumed.dead) | "CoOwnersRetireDead" >> _Step(
            _Retire(self.store, self.round_index), ("stats",)
        )
        return retired.state, retired.stats


class ProposalRound(beam.PTransform):
    """One round of Alg. 1: proposals, unanimous selection, saturation."""

    def __init__(self, store: SideStore, round_index: int):
        super().__init__()
        self.store, self.round_index = store, round_index

    def expand(self, inputs):
        users, records = inputs
        proposed = users | "UsersPropose" >> beam.ParDo(_Propose(self.store)).with_outputs("proposals", main="state")
        selected = (records, proposed.proposals) | "RecordsSelectUnanimous" >> _Step(
            _Select(self.store, self.round_index), ("accepted", "stats")
        )
        users, death_stats = (proposed.state, selected.accepted) | "Saturate" >> Saturate(self.store, self.round_index)
        return users, selected.state, (selected.stats, death_stats)


# --- outputs ------------------------------------------------------------------------------------
