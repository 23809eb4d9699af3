"""madp's DaskRunner (beam_pipelines/dask_runner.py) on tiny pipelines, one test per fix of Beam's own
DaskRunner, which fails each of them (Beam 2.77): a cluster of two worker processes, two partitions
per Create.
"""

from __future__ import annotations

import dataclasses
import os
import uuid

import apache_beam as beam
import pytest
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.runner import PipelineResult, PipelineRunner, PipelineState
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from madp.beam.pipeline import MADP_DASK_RUNNER, pipeline_options, run

pytestmark = [pytest.mark.beam, pytest.mark.runners]


@pytest.fixture
def pipeline(dask_cluster):
    options = [f"--runner={MADP_DASK_RUNNER}", f"--dask_client_address={dask_cluster.address}", "--dask_npartitions=2"]
    return beam.Pipeline(options=PipelineOptions(options))


def finished(pipeline: beam.Pipeline):
    result = pipeline.run()
    result.wait_until_finish()
    return result


class _SplitOdd(beam.DoFn):
    def process(self, number):
        if number % 2:
            yield beam.pvalue.TaggedOutput("odd", number)
        else:
            yield number


def test_each_output_of_a_step_has_its_own_values(pipeline):
    numbers = pipeline | beam.Create(range(10))
    split = numbers | beam.ParDo(_SplitOdd()).with_outputs("odd", main="even")
    assert_that(split.even, equal_to([0, 2, 4, 6, 8]), label="Even")
    assert_that(split.odd, equal_to([1, 3, 5, 7, 9]), label="Odd")
    finished(pipeline)


def _write(value, path: str) -> None:
    with open(path, "w") as handle:
        handle.write(repr(value))


def test_every_sink_runs(pipeline, tmp_path):
    numbers = pipeline | beam.Create(range(4))
    _ = numbers | beam.combiners.ToList() | beam.Map(sorted) | "Write" >> beam.Map(_write, str(tmp_path / "all"))
    _ = numbers | "Sum" >> beam.CombineGlobally(sum) | "WriteSum" >> beam.Map(_write, str(tmp_path / "sum"))
    finished(pipeline)
    assert (tmp_path / "all").read_text() == "[0, 1, 2, 3]"
    assert (tmp_path / "sum").read_text() == "6"


class _NoteBundle(beam.DoFn):
    """A file under `directory` for each bundle (a task on one partition)."""

    def __init__(self, directory: str):
        self.directory = directory

    def start_bundle(self):
        open(os.path.join(self.directory, uuid.uuid4().hex), "w").close()

    def process(self, element):
        yield element


def test_partitions_do_not_multiply_along_joins(pipeline, tmp_path):
    keyed = pipeline | beam.Create([(key, key) for key in range(20)])
    for join in range(3):  # each a Flatten of two PCollections of two partitions, then a GroupByKey
        keyed = (
            {"left": keyed, "right": keyed}
            | f"Join{join}" >> beam.CoGroupByKey()
            | f"Left{join}" >> beam.MapTuple(lambda key, sides: (key, sides["left"][0]))
        )
    _ = keyed | beam.ParDo(_NoteBundle(str(tmp_path)))
    finished(pipeline)
    assert len(os.listdir(tmp_path)) == 2


class _SumPerBundle(beam.DoFn):
    def start_bundle(self):
        self.total = 0

    def process(self, number):
        Metrics.counter("test", "numbers").inc()
        self.total += number

    def finish_bundle(self):
        yield WindowedValue(self.total, 0, [GlobalWindow()])


def test_finish_bundle_outputs_are_kept(pipeline):
    sums = pipeline | beam.Create(range(10)) | beam.ParDo(_SumPerBundle())
    assert_that(sums, equal_to([0 + 1 + 2 + 3 + 4, 5 + 6 + 7 + 8 + 9]))
    finished(pipeline)


def test_metrics_count_each_element_once_and_the_client_closes(pipeline):
    _ = pipeline | beam.Create(range(10)) | beam.ParDo(_SumPerBundle())
    result = finished(pipeline)
    counters = result.metrics().query(MetricsFilter().with_namespace("test"))["counters"]
    assert [(counter.key.metric.name, counter.committed) for counter in counters] == [("numbers", 10)]
    assert result.client.status == "closed"


@pytest.mark.parametrize("name", ["DaskRunner", "apache_beam.runners.dask.dask_runner.DaskRunner"])
def test_madp_runs_its_own_dask_runner_with_a_task_per_partition(name):
    from apache_beam.runners.dask.dask_runner import DaskOptions

    options = pipeline_options(["--runner", name, "--dask_client_address", "localhost:1", "--partitions", "6"])
    assert options.view_as(StandardOptions).runner == MADP_DASK_RUNNER
    assert options.view_as(DaskOptions).npartitions == 6
    explicit = pipeline_options(["--runner", name, "--dask_npartitions", "3", "--partitions", "6"])
    assert explicit.view_as(DaskOptions).npartitions == 3


class _NoMetrics(PipelineResult):
    def __init__(self):
        super().__init__(PipelineState.DONE)

    def wait_until_finish(self, duration=None):
        return self.state

    def metrics(self):
        raise NotImplementedError


class _RunnerWithoutMetrics(PipelineRunner):
    def run_pipeline(self, pipeline, options):
        return _NoMetrics()


def test_a_runner_without_metrics_gives_no_counters(tmp_path):
    assert run(beam.Pipeline(runner=_RunnerWithoutMetrics()), "madp", str(tmp_path)) == {}


def test_a_shuffle_of_many_partitions_groups_every_key_in_two_stages(dask_cluster):
    options = [f"--runner={MADP_DASK_RUNNER}", f"--dask_client_address={dask_cluster.address}", "--dask_npartitions=50"]
    pipeline = beam.Pipeline(options=PipelineOptions(options))
    pairs = [(f"key {i % 37}", i) for i in range(600)]
    grouped = (
        pipeline | beam.Create(pairs) | beam.GroupByKey() | beam.MapTuple(lambda key, values: (key, sorted(values)))
    )
    expected = {key: sorted(v for k, v in pairs if k == key) for key, _ in pairs}
    assert_that(grouped, equal_to(list(expected.items())))
    finished(pipeline)


@pytest.mark.parametrize(("partitions", "pieces"), [(20, 400), (160, 4160)])
def test_the_shuffle_sends_n_squared_pieces_up_to_32_partitions_and_2_n_sqrt_n_above(partitions, pieces):
    from madp.beam.dask_runner import _Graph

    graph = _Graph(None, None)
    inputs = [graph._data("input", []) for _ in range(partitions)]
    outputs = graph._group_by_key("shuffle", inputs)
    assert len(outputs) == partitions
    assert sum(key.startswith("shuffle.piece") for key in graph.tasks) == pieces


def _dataclasses_of_arrays(module) -> list[type]:
    return [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and cls.__module__ == module.__name__
        and any(kind in str(field.type) for field in dataclasses.fields(cls) for kind in ("np.ndarray", "pa.Array"))
    ]


def test_every_element_of_arrays_is_sized_by_its_arrays():
    """Dask places, balances and spills work by `sizeof`, which falls back to `sys.getsizeof`: an
    element class that did not count its arrays measured 56 bytes for a 30 MB record partition, and
    the scheduler moved such partitions to idle workers as if they cost nothing (the largest worker
    of a 10M-record bounding held 855 MB, against 525 MB for the median)."""
    import dask.sizeof
    import numpy as np
    import pyarrow as pa

    from madp.beam import batch, batch_join, batch_sample
    from madp.core import batch_files, batch_steps, bound_steps, bounding, records
    from madp.core.columnar import Columnar

    travelling = [
        cls
        for module in (batch, batch_join, batch_sample, batch_steps, bound_steps)
        for cls in _dataclasses_of_arrays(module)
    ]
    travelling += [batch_files.FileRows, bounding.UserSide, records.RecordChunk]
    assert len(travelling) > 12
    assert [cls.__name__ for cls in travelling if not issubclass(cls, Columnar)] == []

    keys = np.arange(100_000, dtype=np.int64)
    partition = bound_steps.RecordPartition(3, keys, pa.array(keys), keys, keys, np.zeros(len(keys), bool))
    arrays = 4 * keys.nbytes + len(keys)
    assert arrays < dask.sizeof.sizeof([(3, partition)]) < arrays + 1000
