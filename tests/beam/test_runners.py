"""The runner configs in runners/: each is a valid `madp run` config, every Beam stage's pipeline
constructs and serializes with each runner's options (nothing is submitted), and the DirectRunner
gives the same bytes with one worker process as with several."""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os

import apache_beam as beam
import pytest
import yaml
from apache_beam.runners.runner import PipelineResult, PipelineRunner, PipelineState
from conftest import ROOT

from madp.beam.batch import BatchPipeline
from madp.beam.bound import BoundPipeline
from madp.beam.monte_carlo import ChunkResults
from madp.beam.pipeline import pipeline_options, run
from madp.cli import main
from madp.core.bounding import Control
from madp.core.selection import BoundOptions
from madp.engines.batching import BatchOptions
from madp.jobs.run_config import RunConfig
from madp.jobs.run_plan import stages_of

pytestmark = [pytest.mark.beam]

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "runners", "*.yaml")))


def test_every_runner_has_a_config():
    assert [os.path.basename(c) for c in CONFIGS] == ["dataflow.yaml", "direct.yaml", "flink.yaml", "spark.yaml"]


@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_runner_config_is_a_valid_job(config):
    stages = [stage.name for stage in stages_of(RunConfig.read(config, []))]
    assert stages == ["bound", "verify-bound", "batch", "verify-batches", "calibrate", "train"]


def _stage_pipelines(beam_args: list[str], work: str) -> dict[str, beam.Pipeline]:
    """One pipeline per Beam stage of madp, built with `beam_args`, not run."""
    pipelines = {}
    bound = beam.Pipeline(options=pipeline_options(beam_args))
    _ = bound | "Bound" >> BoundPipeline(
        [os.path.join(work, "records.parquet")],
        os.path.join(work, "bound"),
        BoundOptions(max_contributions=4),
        partitions=8,
        rounds=3,
        local_finish_incidences=1000,
        capacities=None,
        control=Control(duplicates=False, max_rounds=None),
        run_dir=os.path.join(work, "bound", "_work", "run-0000"),
        resume_from=None,
    )
    pipelines["bound"] = bound
    batch = beam.Pipeline(options=pipeline_options(beam_args))
    _ = batch | "Batch" >> BatchPipeline(
        [os.path.join(work, "records.parquet")],
        [os.path.join(work, "selected.parquet")],
        work,
        os.path.join(work, "batches"),
        ("features",),
        BatchOptions(seed=0, steps=100, batch_size=50, min_sep=4),
        8,
        os.path.join(work, "summary.json"),
        errors_dir=os.path.join(work, "input-errors"),
    )
    pipelines["batch"] = batch
    accounting = beam.Pipeline(options=pipeline_options(beam_args))
    _ = accounting | "ChunkTasks" >> beam.Create([(0, 1.0)]) | "MonteCarlo" >> ChunkResults(float)
    pipelines["monte-carlo"] = accounting
    return pipelines


@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_every_stage_pipeline_constructs_and_serializes_with_the_runners_options(config, tmp_path):
    section = yaml.safe_load(open(config))["bound"]
    beam_args = ["--runner", section["runner"], *map(str, section.get("runner_options", []))]
    # --dry_run: else the Dataflow options' validation asks GCS whether the temp and staging buckets keep
    # deleted files, retrying for Google credentials for six minutes on a machine that has none
    beam_args += ["--dry_run", "true"]
    for name, pipeline in _stage_pipelines(beam_args, str(tmp_path)).items():
        proto = pipeline.to_runner_api()  # pickles every DoFn and closure, as submission would
        labels = {transform.unique_name for transform in proto.components.transforms.values()}
        top = {"bound": "Bound", "batch": "Batch", "monte-carlo": "MonteCarlo"}
        assert top[name] in labels and len(labels) > 5, (name, sorted(labels)[:10])
        assert type(pipeline.runner).__name__.endswith(section["runner"])  # DirectRunner: SwitchingDirectRunner


def test_dataflow_dry_run_produces_the_job_graph(tmp_path):
    pytest.importorskip(
        "apache_beam.runners.dataflow.internal.apiclient",
        reason="the Beam GCP extra (pip install -e '.[gcp]') is not installed",
    )
    section = yaml.safe_load(open(os.path.join(ROOT, "runners", "dataflow.yaml")))["bound"]
    beam_args = ["--runner", "DataflowRunner", *map(str, section["runner_options"]), "--dry_run", "True"]
    pipeline = _stage_pipelines(beam_args, str(tmp_path))["bound"]
    result = pipeline.run()  # --dry_run: the job description is built, nothing is submitted
    job = json.loads(str(result.job))
    assert job["name"] and result.state == "DONE"


def _bytes_of(directory) -> str:
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            if name.endswith((".parquet", ".tfrecord")):
                digest.update(name.encode() + open(os.path.join(root, name), "rb").read())
    return digest.hexdigest()


def test_direct_runner_in_process_and_in_worker_processes_writes_the_same_bytes(tmp_path, capsys):
    """The DirectRunner in process, in a worker process, and in two worker processes, with different
    partitions, gives the same files."""
    from conftest import write_records

    from madp.tools.data.synthetic import GraphSpec, generate, to_table

    data = write_records(
        str(tmp_path / "records.jsonl"), to_table(generate(GraphSpec(records=3000, features=4, seed=5))).to_pylist()
    )
    digests = []
    modes = (("in_memory", "4", "1"), ("multi_processing", "7", "1"), ("multi_processing", "5", "2"))
    for mode, partitions, workers in modes:
        runner_options = ["--partitions", partitions, "--direct_running_mode", mode, "--direct_num_workers", workers]
        name = f"{mode}-{workers}"
        config = {
            "run_dir": str(tmp_path / f"run-{name}"),
            "input": data,
            "bound": {"max_contributions": 2, "runner_options": runner_options},
            "batch": {
                "steps": 40,
                "batch_size": 60,
                "min_sep": 3,
                "output_shards": 2,
                "seed": 9,
                "runner_options": runner_options,
            },
        }
        path = tmp_path / f"job-{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        assert main(["-q", "run", str(path)]) == 0
        capsys.readouterr()
        digests.append((_bytes_of(tmp_path / f"run-{name}" / "bound"), _bytes_of(tmp_path / f"run-{name}" / "batches")))
    assert digests[0] == digests[1] == digests[2]


@pytest.mark.parametrize("runner", [[], ["--runner", "PortableRunner"]])
def test_a_timed_flush_of_the_workers_data_plane_is_refused(tmp_path, capsys, runner):
    """The SDK workers' timed flush (an experiment of Beam's) has the race flush_data_by_size avoids."""
    from conftest import write_records

    data = write_records(str(tmp_path / "r.jsonl"), [{"id": 1, "users": [1]}])
    experiment = ["--experiments", "data_buffer_time_limit_ms=1000"]
    assert main(["bound", data, str(tmp_path / "out"), "-k", "1", *runner, *experiment]) == 2
    assert "loses elements" in capsys.readouterr().err
    assert not (tmp_path / "out" / "selected").exists()


def test_madp_runs_the_direct_runner_with_a_data_plane_that_flushes_by_size_only(monkeypatch):
    """Beam 2.77's timed flush of a data stream clears what a step wrote while the flush waited
    (pipeline.flush_data_by_size): madp's runs create no such stream, where Beam's own do."""
    import apache_beam as beam
    from apache_beam.runners.portability.fn_api_runner import worker_handlers
    from apache_beam.runners.worker import data_plane

    from madp.beam.pipeline import pipeline_options, run

    timed = []
    original = data_plane.TimeBasedBufferingClosableOutputStream.__init__

    def counted(self, *args, **kwargs):
        timed.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(data_plane.TimeBasedBufferingClosableOutputStream, "__init__", counted)

    def pipeline():
        options = ["--direct_num_workers", "2", "--direct_running_mode", "multi_threading"]
        p = beam.Pipeline(options=pipeline_options(options))
        _ = p | beam.Create(range(40)) | beam.Map(lambda n: (n % 3, n)) | beam.GroupByKey()
        return p

    monkeypatch.setattr(worker_handlers, "DATA_BUFFER_TIME_LIMIT_MS", 1000)  # Beam's default
    pipeline().run().wait_until_finish()
    assert timed, "Beam's own run should have timed streams: this test would see nothing"
    timed.clear()
    run(pipeline(), "madp", "unused-errors-dir")
    assert timed == []


def test_madp_runs_beams_direct_runner_without_its_first_try_on_prism(monkeypatch):
    """Beam 2.77's DirectRunner first hands a pipeline to the Prism runner (a binary it downloads:
    where the machine reaches GitHub the job runs there, untested by madp): madp's runs go to the
    FnApiRunner directly, where Beam's own run tries Prism first."""
    import apache_beam as beam
    from apache_beam.runners.portability import prism_runner
    from apache_beam.runners.portability.fn_api_runner import fn_runner

    from madp.beam.pipeline import pipeline_options, run

    tried = []
    original = fn_runner.FnApiRunner.run_pipeline

    def recorded(self, ran, pipeline, options):
        ran.append(pipeline)
        return original(self, pipeline, options)

    def refused(self, pipeline, options):
        tried.append(pipeline)
        raise RuntimeError("no Prism here")  # Beam then falls back to the FnApiRunner

    monkeypatch.setattr(prism_runner.PrismRunner, "run_pipeline", refused)

    def pipeline():
        p = beam.Pipeline(options=pipeline_options(["--direct_running_mode", "in_memory"]))
        _ = p | beam.Create(range(10)) | beam.Map(lambda n: (n % 3, n)) | beam.GroupByKey()
        return p

    pipeline().run().wait_until_finish()
    assert tried, "Beam's own DirectRunner should try Prism first: this test would see nothing"
    tried.clear()
    # ... and madp's runs the pipeline as built on the FnApiRunner, as Beam's does after Prism (no
    # round trip through the runner API, which rebuilds the pipeline with placeholder coders)
    built, ran = pipeline(), []
    monkeypatch.setattr(fn_runner.FnApiRunner, "run_pipeline", functools.partialmethod(recorded, ran))
    run(built, "madp", "unused-errors-dir")
    assert tried == [] and ran == [built]


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
