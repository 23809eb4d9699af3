"""Monte Carlo accounting on a Beam runner, for sample counts beyond one machine.

Each wave of chunks of estimate-verify-release (`madp.accounting.mc_delta.stream_chunks`) becomes one pipeline
run: its seeded chunk tasks are the elements, spread over workers, each turned into its statistics
(hockey-stick sums and betting steps); they come back to the driver through one small JSON file.
Chunks are seeded by (seed, chunk) and the driver reads them in seed order, so every estimate and
verification stops where the local one does, whatever the runner and the number of workers.
"""

from __future__ import annotations

import json
import logging
import tempfile
import uuid

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import GoogleCloudOptions

from madp.beam.job_servers import prepare_runner
from madp.beam.pipeline import flush_data_by_size, pipeline_options, without_prism

log = logging.getLogger("madp.accounting")


class ChunkResults(beam.PTransform):
    """(index, task) -> [(index, fn(task)), ...] as one list: the tasks' results, spread over workers."""

    def __init__(self, fn):
        super().__init__()
        self._fn = fn

    def expand(self, tasks):
        fn = self._fn
        return (
            tasks
            | "SpreadChunks" >> beam.Reshuffle()
            | "ChunkStatistics" >> beam.MapTuple(lambda index, task: (index, fn(task)))
            | "Collect" >> beam.combiners.ToList()
        )


class BeamTaskMap:
    """A `map` over chunk tasks that runs each call as one Beam pipeline (see `madp.accounting.mc_delta.task_map`);
    results pass through --temp_location, or a local directory removed on exit."""

    def __init__(self, beam_args: list[str]):
        self._options = pipeline_options(beam_args)
        prepare_runner(self._options)
        self._local = None
        self._results_dir = self._options.view_as(GoogleCloudOptions).temp_location
        if not self._results_dir:
            self._local = tempfile.TemporaryDirectory(prefix="madp-monte-carlo-")
            self._results_dir = self._local.name

    def __enter__(self) -> BeamTaskMap:
        return self

    def __exit__(self, *exc) -> None:
        if self._local is not None:
            self._local.cleanup()

    def __call__(self, fn, tasks) -> list:
        tasks = list(tasks)
        path = FileSystems.join(self._results_dir, f"chunk-results-{uuid.uuid4().hex}.json")
        flush_data_by_size()
        with beam.Pipeline(options=self._options) as pipeline:
            without_prism(pipeline)
            _ = (
                pipeline
                | "ChunkTasks" >> beam.Create(list(enumerate(tasks)))
                | "MonteCarlo" >> ChunkResults(fn)
                | "WriteResults" >> beam.Map(_write_json, path)
            )
        with FileSystems.open(path) as handle:
            results = dict(json.loads(handle.read().decode()))
        FileSystems.delete([path])
        if sorted(results) != list(range(len(tasks))):
            raise RuntimeError(f"Monte Carlo pipeline returned {len(results)} of {len(tasks)} chunk results")
        log.info("Beam Monte Carlo run: %d chunks", len(tasks))
        return [results[index] for index in range(len(tasks))]


def _write_json(value, path: str) -> None:
    with FileSystems.create(path) as handle:
        handle.write(json.dumps(value).encode())
