"""The hand-off of batches at a URL to the trainer (`madp.beam.remote_batches`): TensorFlow reads no gs://,
s3:// or hdfs:// path, so `madp train` copies such batches into a local folder (--batches-copy) through Beam's
file systems (set up with --file-system-options) first, each file checked against its batch report. A Beam
file system registered for a scheme of the tests' own (`madptest://`, local files under it) stands in for a
remote store."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

import madp

pytest.importorskip("tensorflow")

from apache_beam.io.localfilesystem import LocalFileSystem  # noqa: E402

from madp.beam.remote_batches import default_copy_folder  # noqa: E402
from madp.cli import main  # noqa: E402
from madp.core.errors import InputError  # noqa: E402
from madp.core.selection import BoundOptions  # noqa: E402
from madp.engines.batch_local import run_local as batch_local  # noqa: E402
from madp.engines.batching import BatchOptions  # noqa: E402
from madp.engines.local_engine import run_local as bound_local  # noqa: E402
from madp.tools.data.synthetic import GraphSpec, generate, write_dataset  # noqa: E402
from madp.training.outputs import evaluation_of  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.beam]

SCHEME = "madptest"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = "examples/demo.yaml"


class _TestStore(LocalFileSystem):
    """Local files as `madptest://PATH`: Beam picks a file system by its scheme, so every URL of the
    scheme is read through this one, as gs:// through Beam's GCSFileSystem."""

    @classmethod
    def scheme(cls):
        return SCHEME

    def exists(self, path):
        return super().exists(_local(path))

    def open(self, path, *args, **kwargs):
        return super().open(_local(path), *args, **kwargs)


def _local(path: str) -> str:
    return path.removeprefix(f"{SCHEME}://")


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """A finished `madp batch` output on local disk, and its URL in the tests' store."""
    work = tmp_path_factory.mktemp("remote")
    spec = GraphSpec(records=300, features=4, seed=3)
    data = str(work / "records.parquet")
    write_dataset(generate(spec), spec, data, shards=1)
    bound_local(data, str(work / "bounded"), BoundOptions(max_contributions=2))
    batch_local(str(work / "bounded"), data, str(work / "batches"), BatchOptions(seed=0, steps=4, batch_size=8))
    return work, f"{SCHEME}://{work / 'batches'}"


def _train(url: str, output: str, *options: str, copy=None) -> int:
    copied = [] if copy is None else ["--batches-copy", str(copy)]
    return main(["-q", "train", url, output, "--mechanism", "none", "--seed", "1", *copied, *options])


def test_train_reads_batches_at_a_url_from_a_checked_local_copy(batches, tmp_path, capsys):
    work, url = batches
    copy = tmp_path / "copy"
    evaluated = ["--eval-data", str(work / "records.parquet"), "--eval-every", "4"]
    assert _train(url, str(tmp_path / "model"), *evaluated, copy=copy) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == 4 and result["batches"] == str(copy)  # what it trained on: the copy
    original = sorted(name for name in os.listdir(work / "batches") if not name.startswith("."))
    assert sorted(name for name in os.listdir(copy) if not name.startswith(".")) == original
    for name in original:
        assert (copy / name).read_bytes() == (work / "batches" / name).read_bytes()
    # the same model as a training on the batches themselves, and the same metrics.json but for the paths
    assert _train(str(work / "batches"), str(tmp_path / "local"), *evaluated) == 0
    finals = [evaluation_of(str(tmp_path / run), internal=True)["final"] for run in ("model", "local")]
    assert finals[0] == finals[1] and "loss" in finals[0]
    recorded = [json.loads((tmp_path / run / "metrics.json").read_text()) for run in ("model", "local")]
    assert recorded[0]["batches"] == str(copy) and recorded[1]["batches"] == str(work / "batches")
    paths = ("batches", "output", "evaluation")
    assert [{key: value for key, value in each.items() if key not in paths} for each in recorded] == [
        {key: value for key, value in recorded[1].items() if key not in paths}
    ] * 2
    # a second training on the same URL keeps the files the copy already holds
    kept = {name: (copy / name).stat().st_mtime_ns for name in original if name.startswith("batches-")}
    assert _train(url, str(tmp_path / "again"), copy=copy) == 0
    assert {name: (copy / name).stat().st_mtime_ns for name in kept} == kept


def test_a_python_caller_gives_the_copy_and_the_file_system_options_as_options(batches, tmp_path):
    work, url = batches
    copy = tmp_path / "copy"
    result = madp.train(
        url, str(tmp_path / "model"), mechanism="none", seed=1, batches_copy=str(copy), file_system_options=[]
    )
    assert result.metrics.settings["batches"] == str(copy) and (copy / "report.json").exists()
    with pytest.raises(InputError, match="--hdfs_hots"):
        madp.train(
            url, str(tmp_path / "again"), mechanism="none", batches_copy=str(copy), file_system_options=["--hdfs_hots"]
        )


def test_madp_run_takes_them_in_the_train_section_and_leaves_them_out_of_the_fingerprint(monkeypatch):
    from madp.cli import parser
    from madp.core.options import options_from
    from madp.jobs.run_config import RunConfig
    from madp.jobs.run_plan import stages_of
    from madp.training.options import TrainOptions

    monkeypatch.chdir(ROOT)
    given = ["train.batches_copy=/tmp/copy", "train.file_system_options=--hdfs_host namenode --hdfs_port 9870"]
    planned = {stage.name: stage for stage in stages_of(RunConfig.read(DEMO, given))}
    plain = {stage.name: stage for stage in stages_of(RunConfig.read(DEMO, []))}
    for name in ("train", "baseline"):
        stage = planned[name]
        assert stage.step.options.batches_copy == "/tmp/copy"
        assert stage.step.options.file_system_options == ("--hdfs_host", "namenode", "--hdfs_port", "9870")
        args, _ = parser().parse_known_args(stage.command)
        assert options_from(TrainOptions, args) == stage.step.options
        assert stage.parameters == plain[name].parameters  # a run directory trained without them is up to date


def test_a_batch_file_that_differs_from_its_report_is_refused_by_name(batches, tmp_path, capsys):
    work, _ = batches
    altered = tmp_path / "batches"
    shutil.copytree(work / "batches", altered)
    first = sorted(altered.glob("batches-*.tfrecord"))[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 1
    first.write_bytes(bytes(data))
    copy = tmp_path / "copy"
    assert _train(f"{SCHEME}://{altered}", str(tmp_path / "model"), copy=copy) == 2
    error = capsys.readouterr().err
    assert f"{SCHEME}://{first}" in error and "SHA-256" in error
    assert not (copy / first.name).exists() and not (copy / "report.json").exists()


def test_the_default_copy_goes_to_the_users_cache(batches, tmp_path, monkeypatch, capsys):
    _, url = batches
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert _train(url, str(tmp_path / "model")) == 0
    (folder,) = (tmp_path / "cache" / "madp" / "batches").iterdir()
    assert str(folder) == default_copy_folder(url)
    assert (folder / "report.json").exists() and list(folder.glob("batches-*.tfrecord"))


@pytest.mark.parametrize(("url", "extra"), [("s3://bucket/batches", "aws"), ("hdfs://namenode/batches", "hadoop")])
def test_a_url_whose_file_system_is_not_installed_names_beams_extra(url, extra, tmp_path, capsys):
    client = {"aws": "boto3", "hadoop": "hdfs"}[extra]
    if importlib.util.find_spec(client) is not None:
        pytest.skip(f"{client} is installed: Beam's {url.split(':')[0]}:// file system is here")
    assert _train(url, str(tmp_path / "model"), copy=tmp_path / "copy") == 2
    error = capsys.readouterr().err
    assert url in error and f"apache-beam[{extra}]" in error
    assert not (tmp_path / "copy").exists()


def test_a_scheme_beam_has_no_file_system_for_is_named(tmp_path, capsys):
    assert _train("nosuchstore://bucket/batches", str(tmp_path / "model")) == 2
    assert "nosuchstore://bucket/batches: Beam has no nosuchstore:// file system" in capsys.readouterr().err


def test_file_system_options_beam_does_not_know_are_refused(batches, tmp_path, capsys):
    _, url = batches
    given = ["--file-system-options", "--hdfs_host namenode --hdfs_hots namenode"]
    assert _train(url, str(tmp_path / "model"), *given, copy=tmp_path / "copy") == 2
    assert "--hdfs_hots" in capsys.readouterr().err
