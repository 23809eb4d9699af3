"""What a job asks of batch formation, and whether the user-record graph allows it: the largest expected batch
size b-min-sep sampling reaches on a selection (and the p it needs), and where truncation is accounted the
truncation delta at the target epsilon with the smallest `--max-batch-size` that keeps it within a stated share
of delta. Computed from the graph alone (public under the fixed-graph model), with the sampler's own
calibration; each problem names the option to change and a value that works. `madp recommend-k` checks each k
it sweeps (`madp.tools.planning.recommend`), `madp run` its own k before it bounds (`job_feasibility`)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np
import pyarrow.compute as pc

from madp.accounting.truncation import REFUSED_SHARE, smallest_max_batch_size, truncation_delta
from madp.core import records as rec
from madp.core import sampling
from madp.core.bounding import Capacities
from madp.core.selection import BoundOptions, read_capacities
from madp.engines.local_engine import bound_records, read_input

DEFAULT_TRUNCATION_SHARE = 0.1  # of delta: the mechanism keeps 90%, so sigma barely moves


class OptionNames(NamedTuple):
    """How a message names the options it asks to change: flags of `madp recommend-k`, or keys of a
    `madp run` config."""

    batch_size: str
    min_sep: str
    max_batch_size: str
    max_contributions: str
    bands: str


FLAGS = OptionNames("--batch-size", "--min-sep", "--max-batch-size", "--k", "--bands")
CONFIG_KEYS = OptionNames(
    "batch.batch_size", "batch.min_sep", "batch.max_batch_size", "bound.max_contributions", "calibrate.bands"
)


class BatchTarget(NamedTuple):
    """What the job asks of batch formation and of the accounting of truncation."""

    steps: int
    batch_size: float
    min_sep: int
    delta: float
    epsilon: float | None  # the target; None where the job gives sigma (its epsilon is not known here)
    accounts_truncation: bool  # amplified accounting (DP-SGD on Poisson batches): truncation costs delta
    max_batch_size: int | None = None  # the job's own B_max, checked; None: the smallest within the share
    truncation_share: float = DEFAULT_TRUNCATION_SHARE
    bands: int = 1
    names: OptionNames = FLAGS


@dataclasses.dataclass(frozen=True)
class BatchFeasibility:
    """Whether the batches a job asks for can be formed on one selection, and what they need."""

    units: int  # record copies the selection holds: what the sampler draws from
    reach: sampling.Reach  # the largest expected batch size, and its p
    sampling_probability: float | None  # p of the asked batch size; None where unreachable
    max_batch_size: int | None  # the job's B_max, or the smallest within the share (amplified only)
    truncation_delta: float  # at max_batch_size and the target epsilon (0 where not accounted)
    problems: tuple[str, ...]  # why the job cannot run, each with what to change

    @property
    def feasible(self) -> bool:
        return not self.problems


class Graph(NamedTuple):
    """The user-record graph of the valid input records (users as dense indices, records in order)."""

    arity: np.ndarray
    user_of_incidence: np.ndarray
    users: int

    @property
    def record_of_incidence(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.arity), dtype=np.int64), self.arity)


def graph_of(chunk: rec.RecordChunk) -> Graph:
    users = pc.dictionary_encode(chunk.users).indices.to_numpy(zero_copy_only=False).astype(np.int64)
    return Graph(chunk.arity, users, int(users.max()) + 1 if len(users) else 0)


def _neighbourhood_histogram(graph: Graph, copies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(|N(e)|, units) of the selection `copies`, as `madp batch` calibrates p with: only selected
    records enter the pairs, so a hub user's cost is k^2 rather than its degree squared."""
    selected = copies > 0
    keep = selected[graph.record_of_incidence]
    renumbered = np.cumsum(selected) - 1  # selected records as 0..n-1
    sizes = sampling.neighbourhood_sizes(
        renumbered[graph.record_of_incidence[keep]], graph.user_of_incidence[keep], copies[selected]
    )
    return sampling.size_histogram(np.repeat(sizes, copies[selected]))


def largest_min_sep_reaching(target: float, sizes: np.ndarray, counts: np.ndarray, below: int) -> int | None:
    """The largest b < `below` at which b-min-sep sampling reaches an expected batch size `target`:
    a bisection, as the largest reachable size never grows with b (a longer exclusion leaves fewer
    records eligible at every p), so that a --min-sep of 10^8 takes 27 probes, not 10^8."""

    def reaches(min_sep: int) -> bool:
        return sampling.largest_expected_batch_size(sizes, counts, min_sep).largest >= target

    if below <= 1 or not reaches(1):
        return None
    low, high = 1, below  # reaches(low); high is past the range or does not reach
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if reaches(middle) else (low, middle)
    return low


def batch_feasibility(graph: Graph, copies: np.ndarray, k: int, target: BatchTarget) -> BatchFeasibility:
    """Whether `target`'s batches can be formed on the selection `copies` (bounded at k), from the
    graph only, with the sampler's own calibration; each problem names the option to change and a
    value that works."""
    names, units = target.names, int(copies.sum())
    if units == 0:
        problem = f"k = {k} keeps no record: raise {names.max_contributions}"
        return BatchFeasibility(0, sampling.Reach(0.0, 0.0), None, target.max_batch_size, 0.0, (problem,))
    sizes, counts = _neighbourhood_histogram(graph, copies)
    reach = sampling.largest_expected_batch_size(sizes, counts, target.min_sep)
    if target.batch_size > reach.largest:
        return BatchFeasibility(
            units, reach, None, target.max_batch_size, 0.0, (_unreachable(target, reach, k, sizes, counts),)
        )
    probability = sampling.calibrate_probability(target.batch_size, sizes, counts, target.min_sep)
    if not target.accounts_truncation or target.epsilon is None:
        return BatchFeasibility(units, reach, probability, target.max_batch_size, 0.0, ())
    budget = target.truncation_share * target.delta
    smallest = smallest_max_batch_size(target.steps, units, probability, target.epsilon, budget)
    if target.max_batch_size is None:
        cost = truncation_delta(target.steps, units, probability, smallest, target.epsilon)
        return BatchFeasibility(units, reach, probability, smallest, cost, ())
    cost = truncation_delta(target.steps, units, probability, target.max_batch_size, target.epsilon)
    problems: tuple[str, ...] = ()
    if cost >= REFUSED_SHARE * target.delta:
        problems = (
            f"{names.max_batch_size} {target.max_batch_size}: truncation costs delta {cost:.3g} of the "
            f"{target.delta:g} asked for at epsilon {target.epsilon:g} (calibration refuses "
            f"{REFUSED_SHARE:.0%} or more); use {names.max_batch_size} >= {smallest} (truncation delta "
            f"<= {target.truncation_share:.0%} of delta) or leave it out",
        )
    return BatchFeasibility(units, reach, probability, target.max_batch_size, cost, problems)


def _unreachable(target: BatchTarget, reach: sampling.Reach, k: int, sizes: np.ndarray, counts: np.ndarray) -> str:
    names = target.names
    if target.min_sep == 1:
        kept = int(reach.largest)  # every unit, at p = 1
        return (
            f"{names.batch_size} {target.batch_size:g} exceeds the {kept} records (copies) kept at k = {k}: "
            f"use {names.batch_size} <= {kept}, or a larger {names.max_contributions}"
        )
    largest = math.floor(reach.largest)
    fixes = [f"{names.batch_size} <= {largest}"] if largest >= 1 else []  # not a batch size of 0
    min_sep = largest_min_sep_reaching(target.batch_size, sizes, counts, target.min_sep)
    if min_sep is not None:
        bands = f" (and {names.bands} <= {min_sep})" if target.bands > min_sep else ""
        fixes.append(f"{names.min_sep} <= {min_sep}{bands}")
    fixes = fixes or [f"a larger {names.max_contributions}"]
    return (
        f"{names.batch_size} {target.batch_size:g} unreachable at {names.min_sep} {target.min_sep} with k = {k}: "
        f"largest {math.floor(10 * reach.largest) / 10:.1f} (at p = {reach.probability:.3g}); use {' or '.join(fixes)}"
    )


def job_feasibility(input_path: str, options: BoundOptions, target: BatchTarget) -> BatchFeasibility | None:
    """What `batch_feasibility` says of the selection `madp bound` will make with `options` (the local
    engine's kernels: the engines select alike); None where the input has invalid rows the bound
    would stop at (its own error names them)."""
    chunk, rejects, _, _ = read_input(input_path, options.columns)
    if len(rejects) and options.on_invalid == "error":
        return None
    k = options.max_contributions
    capacities = read_capacities(options.capacities, k) if options.capacities else Capacities(default=k)
    copies = bound_records(chunk, options, capacities).copies
    return batch_feasibility(graph_of(chunk), copies, k, target)
