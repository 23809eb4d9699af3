"""The FlinkRunner's and SparkRunner's job server (madp.beam.job_servers): a jar that cannot be fetched, or no
`java` to start it with, is one line naming the option that fixes it, exit status 2, before any work (an
earlier output stays as it was). Maven Central and its mirror are a local server answering 404 here, as a
registry without Beam's runner artifacts answers: nothing goes to the network."""

from __future__ import annotations

import concurrent.futures
import http.server
import os
import socket
import threading

import grpc
import pytest
import yaml
from apache_beam.utils.subprocess_server import JavaJarServer
from conftest import ROOT, write_records

from madp.beam.job_servers import prepare_runner
from madp.beam.pipeline import pipeline_options
from madp.cli import main
from madp.core.errors import InputError

pytestmark = [pytest.mark.beam]

JAR_OPTIONS = {"FlinkRunner": "--flink_job_server_jar", "SparkRunner": "--spark_job_server_jar"}


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404)

    def log_message(self, *args) -> None:  # the test's output, not the server's log
        pass


@pytest.fixture
def maven_without_runners(monkeypatch):
    """Maven Central and Google's mirror of it, for Beam, as a local server that has no jar: its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(JavaJarServer, "MAVEN_CENTRAL_REPOSITORY", f"{url}/maven2")
    monkeypatch.setattr(JavaJarServer, "GOOGLE_MAVEN_MIRROR", f"{url}/mirror/maven2")
    yield url
    server.shutdown()
    server.server_close()


@pytest.fixture
def bounded(tmp_path, capsys):
    """Records, and an earlier bounding of them: (input, output, the output's report)."""
    records = write_records(
        str(tmp_path / "records.jsonl"),
        [{"id": 0, "users": [1, 2]}, {"id": 1, "users": [1]}, {"id": 2, "users": [2, 3]}],
    )
    output = str(tmp_path / "bounded")
    assert main(["-q", "bound", records, output, "-k", "1", "--runner", "local"]) == 0
    capsys.readouterr()
    with open(os.path.join(output, "report.json"), "rb") as handle:
        return records, output, handle.read()


def _refused(args: list[str], capsys, output: str, report: bytes) -> str:
    """The one line of error of `madp ARGS`, checked: exit status 2, no traceback, `output` untouched."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    with open(os.path.join(output, "report.json"), "rb") as handle:
        assert handle.read() == report, "the earlier bounding should stay as it was"
    return err


@pytest.mark.parametrize("runner", sorted(JAR_OPTIONS))
def test_a_job_server_jar_that_cannot_be_fetched_is_one_line_naming_the_option(
    runner, maven_without_runners, bounded, tmp_path, capsys
):
    records, output, report = bounded
    cache = str(tmp_path / "jars")
    err = _refused(
        ["-q", "bound", records, output, "-k", "1", "--runner", runner, "--jar_cache_dir", cache],
        capsys,
        output,
        report,
    )
    system = runner.removesuffix("Runner").lower()
    assert err.startswith(f"madp bound: error: {runner} needs Beam's {system.capitalize()} job server jar ")
    assert f"(org.apache.beam:beam-runners-{system}-" in err  # the Maven coordinates Beam derives
    assert f"{maven_without_runners}/maven2/org/apache/beam/beam-runners-{system}-" in err
    assert "(HTTP 404; then from Google's mirror of Maven Central: HTTP 404)" in err
    assert f"pass {JAR_OPTIONS[runner]} PATH, or run a job server and pass --job_endpoint HOST:PORT" in err
    assert os.listdir(cache) == []  # no partial jar left for a later run to take


def test_no_java_to_start_the_job_server_is_one_line(maven_without_runners, bounded, tmp_path, monkeypatch, capsys):
    records, output, report = bounded
    monkeypatch.setenv("PATH", str(tmp_path))  # no java on it
    err = _refused(["-q", "bound", records, output, "-k", "1", "--runner", "flink"], capsys, output, report)
    assert err.startswith("madp bound: error: FlinkRunner starts Beam's Flink job server, a Java program,")
    assert "no `java` executable here" in err and "--job_endpoint HOST:PORT" in err


def test_a_given_jar_that_does_not_exist_is_named(bounded, tmp_path, capsys):
    records, output, report = bounded
    missing = str(tmp_path / "job-server.jar")
    args = ["-q", "batch", output, records, str(tmp_path / "batches"), "--steps", "10", "--batch-size", "2"]
    err = _refused([*args, "--runner", "SparkRunner", "--spark_job_server_jar", missing], capsys, output, report)
    assert err == f"madp batch: error: --spark_job_server_jar {missing}: no such file\n"


@pytest.mark.parametrize(
    "options",
    [
        ["--runner", "FlinkRunner", "--flink_master", "flink:8081", "--flink_submit_uber_jar"],
        ["--runner", "SparkRunner", "--spark_submit_uber_jar", "--spark_rest_url", "http://spark:6066"],
        ["--runner", "DirectRunner"],
        ["--runner", "PrismRunner"],
    ],
)
def test_runners_that_start_no_job_server_here_need_nothing_of_this_machine(options, maven_without_runners):
    prepare_runner(pipeline_options(options))  # would fail on the fetch


def test_a_runner_beam_does_not_know_is_one_line_naming_runner(bounded, capsys):
    records, output, report = bounded
    err = _refused(["-q", "bound", records, output, "-k", "1", "--runner", "DaskRunner"], capsys, output, report)
    assert err.startswith("madp bound: error: --runner DaskRunner: Unexpected pipeline runner: DaskRunner.")
    assert "('local' is madp's in-process engine)" in err


@pytest.mark.parametrize("config", ["flink.yaml", "spark.yaml"])
def test_the_runner_configs_go_as_far_as_the_job_server(config, maven_without_runners, tmp_path):
    """runners/flink.yaml and spark.yaml start a job server here (no endpoint, no uber jar), whose jar the
    local registry does not have: their stages stop there, naming the jar's option."""
    for stage in ("bound", "batch"):
        section = yaml.safe_load(open(os.path.join(ROOT, "runners", config)))[stage]
        beam_args = ["--runner", section["runner"], *map(str, section["runner_options"])]
        with pytest.raises(InputError, match=f"pass {JAR_OPTIONS[section['runner']]} PATH"):
            prepare_runner(pipeline_options([*beam_args, "--jar_cache_dir", str(tmp_path)]))


def test_a_job_endpoint_where_no_job_server_answers_is_one_line(bounded, capsys):
    records, output, report = bounded
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("localhost", 0))
        port = unused.getsockname()[1]
    args = ["-q", "bound", records, output, "-k", "1", "--runner", "FlinkRunner", "--job_endpoint", f"localhost:{port}"]
    err = _refused([*args, "--job_server_timeout", "1"], capsys, output, report)
    assert err == (
        f"madp bound: error: --job_endpoint localhost:{port}: no job server answered there within 1 s "
        "(--job_server_timeout): start it, or leave --job_endpoint out for the runner to start one\n"
    )


def test_a_job_endpoint_that_answers_needs_nothing_else_of_this_machine(maven_without_runners):
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("localhost:0")
    server.start()
    try:
        prepare_runner(pipeline_options(["--runner", "FlinkRunner", "--job_endpoint", f"localhost:{port}"]))
    finally:
        server.stop(None)
