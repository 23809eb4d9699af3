"""madp's Dask runner: Beam's DaskRunner, with a translation of the pipeline that runs it as written.

Beam 2.77's DaskRunner (`apache_beam.runners.dask`) turns each transform into a `dask.bag` step, and
gets these wrong:

- a ParDo's outputs lose their tags: every consumer of any output of a multi-output ParDo
  (`.with_outputs`) receives the values of all of them;
- only the last transform applied and its ancestors are computed: any other sink silently never runs;
- `Flatten` is `db.concat`, whose partitions add up: along a chain of Flattens and CoGroupByKeys (a
  round of madp's bounding) the number of tasks multiplies, and so does the graph's memory;
- the outputs of `finish_bundle` are dropped;
- a side input is computed again, by a client inside the worker, in every task that reads it;
- a Flatten of no PCollection (`() | beam.Flatten(pipeline=p)`) cannot be expanded;
- `result.metrics()` raises NotImplementedError, and the client the run opens is never closed.

This runner keeps Beam's overrides of the composite transforms, the Dask options and the client
they describe, and translates the primitives into a dask task graph of its own, in which each
PCollection is a list of partitions, one task each (dask.bag materializes the whole upstream graph
at each step given another collection, such as a side input: madp's bounding pipeline did not
finish translating in two minutes). A ParDo's task (a bundle) returns (tag, value) pairs,
finish_bundle's included, and a task per output keeps its tag's values; GroupByKey is a hash
shuffle that keeps its input's partitions (in two stages above 32 partitions); a Flatten has its
largest input's partitions; a side input is gathered once, as a dependency of the tasks that read
it; every PCollection that nothing reads is computed, on the workers; and each bundle's Beam
metrics come back with the run's result.
Values travel without their windows and timestamps: pipelines in the global window only (madp's
are batch pipelines).
"""

from __future__ import annotations

import math
import operator
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import apache_beam as beam
import dask.distributed as ddist
from apache_beam import pvalue
from apache_beam.internal import pickler
from apache_beam.metrics.execution import MetricsContainer, MetricUpdates
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pipeline import AppliedPTransform, PipelineVisitor, PTransformOverride
from apache_beam.runners.common import DoFnRunner, Receiver
from apache_beam.runners.dask import dask_runner
from apache_beam.runners.dask.overrides import (
    _Create,
    _Flatten,
    _GroupAlsoByWindow,
    _GroupByKeyOnly,
    _Reshuffle,
    dask_overrides,
)
from apache_beam.runners.direct.direct_metrics import DirectMetrics
from apache_beam.runners.worker import statesampler
from apache_beam.transforms.sideinputs import SideInputMap
from apache_beam.transforms.window import GlobalWindows
from apache_beam.utils.counters import CounterFactory
from apache_beam.utils.windowed_value import WindowedValue
from dask.task_spec import DataNode, Task, TaskRef
from dask.tokenize import tokenize

# The tag of a bundle's metric updates among its outputs: not a str, so no output tag of a ParDo.
_METRICS = ("metrics",)
_CREATE_PARTITION_SIZE = 128  # elements per partition of a Create when no Dask option says (Beam's default)
_ONE_STAGE_SHUFFLE = 32  # partitions up to which a GroupByKey sends every piece directly (n^2 pieces)


class _Outputs(dict):
    """A bundle's receivers by output tag (None: the main output), which collect (tag, value) pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[Any, Any]] = []

    def __missing__(self, tag: str | None) -> Receiver:
        receiver = self[tag] = _TagReceiver(tag, self.pairs)
        return receiver


@dataclass
class _TagReceiver(Receiver):
    tag: str | None
    pairs: list[tuple[Any, Any]]

    def receive(self, windowed_value: WindowedValue) -> None:
        self.pairs.append((self.tag, windowed_value.value))


@dataclass(frozen=True)
class _Bundle:
    """A ParDo, applied to one partition (a bundle) by each of its tasks."""

    fn: beam.DoFn
    label: str
    args: tuple
    kwargs: dict
    windowing: beam.Windowing
    views: tuple[tuple[Any, dict], ...]  # each side input's view class (AsSingleton, ...) and options

    def process(self, elements: list, *side_values: list) -> list[tuple[Any, Any]]:
        side_inputs = [
            SideInputMap(view, options, [GlobalWindows.windowed_value(value) for value in values])
            for (view, options), values in zip(self.views, side_values)
        ]
        outputs = _Outputs()
        # A DoFn of its own per bundle, as Beam's direct runner does: a worker's tasks share this
        # object, and a DoFn's fields belong to its bundle.
        runner = DoFnRunner(
            pickler.roundtrip(self.fn),
            self.args,
            self.kwargs,
            side_inputs,
            self.windowing,
            tagged_receivers=outputs,
            step_name=self.label,
        )
        # Beam's Metrics find the step's container through the thread's state sampler.
        metrics, sampler = MetricsContainer(self.label), statesampler.StateSampler("", CounterFactory())
        previous = statesampler.get_current_tracker()
        statesampler.set_current_tracker(sampler)
        try:
            with sampler.scoped_state(self.label, "process", metrics_container=metrics):
                runner.setup()
                runner.start()
                for element in elements:
                    runner.process(GlobalWindows.windowed_value(element))
                runner.finish()
                runner.teardown()
        finally:
            statesampler.set_current_tracker(previous)
        return [*outputs.pairs, (_METRICS, metrics.get_cumulative())]


class _FlattenAny(_Flatten):
    """Beam's Dask Flatten, also of no PCollection at all (`() | beam.Flatten(pipeline=...)`), which
    Beam's cannot expand, and whose output is the pipeline's (Beam's has none: a replacement of the
    steps after it would fail)."""

    def expand(self, inputs):
        if isinstance(inputs, pvalue.PValue):  # PBegin: no input; or a single PCollection
            pipeline, pcolls = inputs.pipeline, [inputs] if isinstance(inputs, pvalue.PCollection) else []
        else:
            pipeline, pcolls = inputs[0].pipeline, list(inputs)
        return pvalue.PCollection(pipeline, is_bounded=all(pcoll.is_bounded for pcoll in pcolls))


class _FlattenOverride(PTransformOverride):
    def matches(self, applied_ptransform: AppliedPTransform) -> bool:
        return type(applied_ptransform.transform) is beam.Flatten

    def get_replacement_transform_for_applied_ptransform(self, applied_ptransform: AppliedPTransform) -> _Flatten:
        return _FlattenAny()


def _tagged(pairs: list[tuple[Any, Any]], tag: Any) -> list:
    return [value for output_tag, value in pairs if output_tag == tag]


def _concatenated(*parts: list) -> list:
    return [value for part in parts for value in part]


def _destined(elements: list[tuple[Any, Any]], partitions: int) -> list[tuple[int, tuple[Any, Any]]]:
    """A partition's (key, value) pairs, each with the output partition of its key: the same in every
    process (unlike `hash` of a str)."""
    return [(int(tokenize(element[0]), 16) % partitions, element) for element in elements]


def _by_digit(pairs: list[tuple[int, Any]], base: int, unit: int) -> list[list[tuple[int, Any]]]:
    """(destination, element) pairs split by one digit of their destination in base `base` (the
    digit of `unit`, a power of the base)."""
    split: list[list[tuple[int, Any]]] = [[] for _ in range(base)]
    for pair in pairs:
        split[pair[0] // unit % base].append(pair)
    return split


def _grouped(*parts: list[tuple[int, tuple[Any, WindowedValue]]]) -> list[tuple[Any, list]]:
    """(destination, (key, value in its window)) pairs, as Beam's GroupByKey gives them: (key, [value])."""
    groups: dict[Any, list] = {}
    for _, (key, windowed) in _concatenated(*parts):
        groups.setdefault(key, []).append(windowed.value)
    return list(groups.items())


def _nothing(values: list) -> None:
    """A sink's partition, once computed, is left on its worker."""


class _Graph(PipelineVisitor):
    """The pipeline as a dask task graph: each PCollection as the keys of its partitions' tasks."""

    def __init__(self, npartitions: int | None, partition_size: int | None) -> None:
        self.npartitions, self.partition_size = npartitions, partition_size
        self.tasks: dict[str, DataNode | Task] = {}
        self.partitions: dict[pvalue.PValue, list[str]] = {}
        self.read: set[pvalue.PValue] = set()
        self.wholes: dict[pvalue.PValue, str] = {}  # a side input's PCollection: its gathering task
        self.metrics: list[str] = []  # each bundle's metric updates
        self._run = uuid.uuid4().hex[:8]  # keys of their own on a cluster that runs other jobs

    def visit_transform(self, node: AppliedPTransform) -> None:
        transform, label = node.transform, node.full_label
        if isinstance(transform, _Create):
            self._output(node, [self._data(label, values) for values in self._split(list(transform.values))])
        elif isinstance(transform, _GroupAlsoByWindow | _Reshuffle):
            # in the global window, _GroupByKeyOnly's groups are final; a reshuffle changes nothing
            self._output(node, self._input(node))
        elif isinstance(transform, beam.ParDo):
            self._par_do(node, transform)
        elif isinstance(transform, _GroupByKeyOnly):
            self._output(node, self._group_by_key(label, self._input(node)))
        elif isinstance(transform, _Flatten):
            inputs = [self._read(pcoll) for pcoll in node.inputs if isinstance(pcoll, pvalue.PCollection)]
            self._output(node, self._flatten(label, inputs))
        else:
            raise NotImplementedError(f"madp's DaskRunner cannot run {type(transform).__name__} ({label})")

    def _par_do(self, node: AppliedPTransform, transform: beam.ParDo) -> None:
        label = node.full_label
        main_input = cast(pvalue.PCollection, next(iter(node.main_inputs.values())))
        if not isinstance(main_input.windowing.windowfn, GlobalWindows):
            raise NotImplementedError(f"madp's DaskRunner runs the global window only ({label})")
        args, kwargs = transform.raw_side_inputs
        views = tuple((type(side), side._view_options()) for side in node.side_inputs)
        bundle = TaskRef(
            self._data(label, _Bundle(transform.fn, label, tuple(args), kwargs, main_input.windowing, views))
        )
        sides = [TaskRef(self._whole(side.pvalue)) for side in node.side_inputs]
        outputs: dict[str | int | None, list[str]] = {tag: [] for tag in node.outputs}
        for partition in self._read(main_input):
            pairs = TaskRef(self._task(label, _Bundle.process, bundle, TaskRef(partition), *sides))
            for tag, keys in outputs.items():
                keys.append(self._task(f"{label}.{tag}", _tagged, pairs, tag))
            self.metrics.append(self._task(f"{label}.metrics", _tagged, pairs, _METRICS))
        for tag, pcoll in node.outputs.items():
            self.partitions[pcoll] = outputs[tag]

    def _group_by_key(self, label: str, partitions: list[str]) -> list[str]:
        """A shuffle by the hash of the key, to as many partitions as the input has. Up to
        `_ONE_STAGE_SHUFFLE` partitions, every input partition sends each output partition its piece
        (n^2 pieces); above, in two stages, as dask's task shuffle does: with partitions numbered in
        base k = ceil(sqrt(n)), the first stage gathers at each position the elements whose
        destination has that position's last digit, from the k positions of its row, and the second
        sends each its first digit, so each task holds about one partition and there are about 2 n k
        pieces (4,160 instead of 25,600 at n = 160)."""
        count = len(partitions)
        stages = 1 if count <= _ONE_STAGE_SHUFFLE else 2
        base = count if stages == 1 else math.isqrt(count - 1) + 1
        # position -> task of its (destination, (key, value)) pairs; after the last stage, position =
        # destination for every pair it holds
        current = {
            position: self._task(f"{label}.destine", _destined, TaskRef(key), count)
            for position, key in enumerate(partitions)
        }
        for stage in range(stages):
            unit, last = base**stage, stage == stages - 1
            pieces: dict[int, list[TaskRef]] = {}
            for position, key in current.items():
                split = TaskRef(self._task(f"{label}.split", _by_digit, TaskRef(key), base, unit))
                for digit in range(base):
                    target = position + (digit - position // unit % base) * unit  # the stage's digit set
                    if last and target >= count:  # no destination there: an empty piece
                        continue
                    piece = self._task(f"{label}.piece", operator.getitem, split, digit)
                    pieces.setdefault(target, []).append(TaskRef(piece))
            gather = _grouped if last else _concatenated
            current = {target: self._task(label, gather, *refs) for target, refs in pieces.items()}
        return [current[position] for position in range(count)]

    def _flatten(self, label: str, inputs: list[list[str]]) -> list[str]:
        """Partition i of the output: partitions i, i + n, i + 2n... of the inputs' (n: the largest
        input's partitions), so that their number does not grow along a chain of Flattens."""
        if len(inputs) == 1:
            return inputs[0]
        if not inputs:
            return [self._data(label, [])]
        count = max(len(keys) for keys in inputs)
        every = [key for keys in inputs for key in keys]
        return [self._task(label, _concatenated, *map(TaskRef, every[index::count])) for index in range(count)]

    def _split(self, values: list) -> list[list]:
        if self.partition_size:
            size = self.partition_size
        elif self.npartitions:
            size = max(1, math.ceil(len(values) / self.npartitions))
        else:
            size = _CREATE_PARTITION_SIZE
        return [values[start : start + size] for start in range(0, len(values), size)] or [[]]

    def _whole(self, pcoll: pvalue.PValue) -> str:
        if pcoll not in self.wholes:
            self.wholes[pcoll] = self._task("side-input", _concatenated, *map(TaskRef, self._read(pcoll)))
        return self.wholes[pcoll]

    def _task(self, name: str, function: Callable, *args: Any) -> str:
        key = f"{name}-{self._run}-{len(self.tasks)}"
        self.tasks[key] = Task(key, function, *args)
        return key

    def _data(self, name: str, value: Any) -> str:
        key = f"{name}-{self._run}-{len(self.tasks)}"
        self.tasks[key] = DataNode(key, value)
        return key

    def _input(self, node: AppliedPTransform) -> list[str]:
        (pcoll,) = node.inputs
        return self._read(pcoll)

    def _read(self, pcoll: pvalue.PValue) -> list[str]:
        self.read.add(pcoll)
        return self.partitions[pcoll]

    def _output(self, node: AppliedPTransform, keys: list[str]) -> None:
        (pcoll,) = node.outputs.values()
        self.partitions[pcoll] = keys

    def sinks(self) -> list[str]:
        """Tasks that compute every PCollection that nothing reads, and keep none of it."""
        unread = [keys for pcoll, keys in self.partitions.items() if pcoll not in self.read]
        return [self._task("sink", _nothing, TaskRef(key)) for keys in unread for key in keys]


class DaskRunnerResult(dask_runner.DaskRunnerResult):
    """A run on Dask. Its metrics are those Beam's `Metrics` recorded in the bundles that made the
    outputs (as committed values: a retried task's attempt is not counted), once the run is done;
    the client is closed once the run is done, failed or cancelled."""

    def __init__(self, client: ddist.Client, sinks: list[ddist.Future], metrics: list[ddist.Future]) -> None:
        super().__init__(client, sinks)
        self._metric_futures = metrics
        self._metrics = DirectMetrics()

    def wait_until_finish(self, duration: int | None = None) -> str:
        try:
            super().wait_until_finish(duration)  # raises a task's exception
            bundles: Iterable[MetricUpdates] = (update for future in self._metric_futures for update in future.result())
            for bundle, updates in enumerate(bundles):
                self._metrics.commit_physical(bundle, updates)
                self._metrics.commit_logical(bundle, updates)
        finally:
            self.client.close()
        return self._state

    def cancel(self) -> str:
        try:
            return super().cancel()
        finally:
            self.client.close()

    def metrics(self) -> DirectMetrics:
        return self._metrics


class DaskRunner(dask_runner.DaskRunner):
    """Executes a pipeline on a Dask distributed client (`--dask_*` options), as Beam's DaskRunner
    does, with the translation this module describes."""

    def run_pipeline(self, pipeline: beam.Pipeline, options: PipelineOptions) -> DaskRunnerResult:
        dask_options = options.view_as(dask_runner.DaskOptions).get_all_options(drop_default=True, current_only=True)
        bag_kwargs = dask_runner.DaskOptions._extract_bag_kwargs(dask_options)
        pipeline.replace_all([_FlattenOverride(), *dask_overrides()])  # ours first, where both match
        graph = _Graph(bag_kwargs.get("npartitions"), bag_kwargs.get("partition_size"))
        pipeline.visit(graph)
        sinks = graph.sinks()
        client = ddist.Client(**dask_options)
        try:
            futures = client.get(graph.tasks, [*sinks, *graph.metrics], sync=False)
        except BaseException:
            client.close()
            raise
        return DaskRunnerResult(client, futures[: len(sinks)], futures[len(sinks) :])
