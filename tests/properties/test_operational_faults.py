"""Faults of the machine rather than of the input, through the command line: a full file system, a
container's memory limit, Ctrl-C. Each is one line on stderr naming what failed (the path or the
limit) and what to do, with a non-zero exit and no traceback; nothing finished is removed, nothing
unfinished passes for finished, and a resumable job stays resumable.

A full disk is a real one: a small tmpfs mounted in a mount namespace of the test's own (`unshare`,
as root or in a user namespace), so every layer that writes (Beam's workers, pyarrow, TensorFlow)
meets the kernel's ENOSPC. The memory limit is read from a cgroup file tree the test points the
reader at, and once from a real cgroup where this machine lets the test make one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import ROOT, crash_at, write_records

from madp.cli import main
from madp.core import errors

BEAM = ["--runner", "DirectRunner", "--direct_running_mode", "in_memory", "--partitions", "3"]
LIMIT = 150 << 20  # a container's 150 MiB


def cli(capsys, *args) -> tuple[int, str]:
    try:
        code = main(["-q", *map(str, args)])
    except KeyboardInterrupt:  # would end the whole test session
        pytest.fail("a KeyboardInterrupt left madp's main")
    return code, capsys.readouterr().err


def rows(count: int) -> list[dict]:
    """Records of two users each, no user with more than two: a bound with K >= 2 selects every one."""
    return [{"id": i, "users": [i, count + i // 2], "features": [i % 7 / 7, 1.0], "label": i % 2} for i in range(count)]


def madp_lines(err: str, command: str) -> list[str]:
    """madp's own lines of a command's stderr (TensorFlow prints start-up lines of its own)."""
    return [line for line in err.splitlines() if line.startswith(f"madp {command}:")]


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


# --- a full file system ---------------------------------------------------------------------------

# In the namespace: mount a tmpfs of argv[2] bytes at argv[1], run each madp command of argv[3] (or
# "grow": remount the tmpfs at 64 MiB, as a user freeing space; "fill": write DISK/.filler until it is
# full), and print what each left there.
SMALL_DISK = """
import json, os, subprocess, sys
disk, size, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=" + size, "tmpfs", disk], check=True)
results = []
for step in steps:
    if step == "grow":
        subprocess.run(["mount", "-o", "remount,size=64m", disk], check=True)
        continue
    if step == "fill":
        try:
            with open(os.path.join(disk, ".filler"), "wb") as filler:
                while True:
                    filler.write(bytes(4096))
                    filler.flush()
        except OSError:
            continue
    done = subprocess.run([sys.executable, "-m", "madp.cli", "-q", *step], capture_output=True, text=True)
    left = sorted(os.path.relpath(os.path.join(root, name), disk) for root, _, names in os.walk(disk) for name in names)
    results.append({"code": done.returncode, "err": done.stderr, "out": done.stdout, "left": left})
print(json.dumps(results))
"""


def on_a_small_disk(disk, size: str, *steps) -> list[dict]:
    """Run madp commands (argument lists; "grow" frees space) with `disk` a tmpfs of `size` of their own."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): a real full file system needs a mount namespace")
    os.makedirs(disk, exist_ok=True)
    steps_json = json.dumps([step if step in ("grow", "fill") else list(map(str, step)) for step in steps])
    done = subprocess.run(
        ["unshare", "--mount", "--map-root-user", sys.executable, "-c", SMALL_DISK, str(disk), size, steps_json],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment(),
        timeout=600,
    )
    if done.returncode != 0 and "mount" in done.stderr and not done.stdout:
        pytest.skip(f"this machine mounts no tmpfs in a namespace of the test's own: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def assert_one_full_disk_line(result: dict, command: str, path: str) -> str:
    (line,) = madp_lines(result["err"], command)
    assert result["code"] == 2 and "Traceback" not in result["err"], result["err"]
    assert line.startswith(f"madp {command}: error: cannot write {path}"), line
    assert "No space left on device" in line and "free space there, or write to another file system" in line
    return line


@pytest.mark.beam
@pytest.mark.slow
@pytest.mark.parametrize("command", ["bound", "batch"])
def test_a_full_disk_under_a_beam_job_is_one_line_and_no_output_passes_for_finished(tmp_path, capsys, command):
    """A worker's write failed with ENOSPC: the DirectRunner relayed it as a RuntimeError's text, and
    madp printed its traceback (and Beam's log of it) instead of the local engine's one line."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(5000))
    disk = tmp_path / "disk"
    if command == "bound":
        run, size = ["bound", data, disk / "out", "-k", "3", *BEAM], "16k"  # the selection: 28 KiB
    else:
        assert cli(capsys, "bound", data, tmp_path / "b", "-k", "3", "--runner", "local")[0] == 0
        run, size = ["batch", tmp_path / "b", data, disk / "out", "--steps", "20", "--batch-size", "50", *BEAM], "64k"
    (result,) = on_a_small_disk(disk, size, run)
    line = assert_one_full_disk_line(result, command, str(disk / "out"))
    assert f"{disk / 'out'} is unfinished (no report.json, which is written last" in line
    assert "run the command again" in line
    assert "out/report.json" not in result["left"] and "out/.madp.lock" not in result["left"], result["left"]
    assert not [name for name in result["left"] if name.endswith((".parquet", ".tfrecord"))], result["left"]


def test_a_full_disk_while_taking_a_lock_leaves_no_lock(tmp_path):
    """The lock's holder was written after the lock file was created: on a full disk an empty .madp.lock
    stayed, and every later run was refused as "being written by another madp process (an unknown
    process)"; the message named OUTPUT, not the file that could not be written."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    disk = tmp_path / "disk"
    bound = ["bound", data, disk / "out", "-k", "2", "--runner", "local"]
    full, freed = on_a_small_disk(disk, "64k", "fill", bound, "grow", bound)
    assert_one_full_disk_line(full, "bound", str(disk / "out" / ".madp.lock"))
    assert full["left"] == [".filler"], full["left"]
    assert freed["code"] == 0, freed["err"]
    assert "out/report.json" in freed["left"] and "out/.madp.lock" not in freed["left"]


def test_a_full_disk_under_generate_leaves_no_truncated_dataset(tmp_path):
    """A .jsonl was written in place: a full disk was a traceback and left a truncated file that
    `madp bound` would read as the dataset."""
    disk = tmp_path / "disk"
    (result,) = on_a_small_disk(disk, "16k", ["generate", disk / "g.jsonl", "--records", "5000"])
    line = assert_one_full_disk_line(result, "generate", str(disk / "g.jsonl"))
    assert line.endswith(f"{disk / 'g.jsonl'} is written whole or not at all: generate again")
    assert result["left"] == []


@pytest.mark.tf
@pytest.mark.slow
def test_a_full_disk_under_training_keeps_its_checkpoint_and_resumes(tmp_path, capsys):
    """TensorFlow's writes (summaries, checkpoints) raise its own errors on a full disk: they were
    tracebacks. The training's checkpoint stays, and --resume finishes it once there is room."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(1500))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")[0] == 0
    batch = ["--steps", "12", "--batch-size", "32", "--min-sep", "2", "--max-batch-size", "64", "--runner", "local"]
    assert cli(capsys, "batch", tmp_path / "b", data, tmp_path / "batches", *batch)[0] == 0
    disk = tmp_path / "disk"
    train = ["train", tmp_path / "batches", disk / "t", "--noise-multiplier", "1", "--bands", "2"]
    train += ["--checkpoint-every", "5", "--eval-every", "6", "--internal-scalars"]
    # 40 KiB hold the logs and the checkpoint of step 5, not the next one beside it
    failed, resumed = on_a_small_disk(disk, "40k", train, "grow", [*train, "--resume"])
    line = assert_one_full_disk_line(failed, "train", str(disk / "t"))
    assert "keeps the checkpoint of step" in line and "the same command with --resume continues" in line, line
    assert "t/metrics.json" not in failed["left"] and "t/model.keras" not in failed["left"]
    assert resumed["code"] == 0, resumed["err"]
    assert json.loads(resumed["out"])["resumed_at"] in (5, 10)
    assert {"t/metrics.json", "t/model.keras", "t/privacy.json"} <= set(resumed["left"])


# --- a container's memory limit -------------------------------------------------------------------


def fake_cgroups(tmp_path, monkeypatch, version: int, limit: int | str) -> str:
    """A cgroup tree for the memory reader, this process in /ctr/job; `limit` set on /ctr (a cgroup
    above it: its limit applies too), no limit in /ctr/job. The file holding `limit`."""
    root = tmp_path / "cgroup"
    if version == 2:
        membership, base, name, unlimited = "0::/ctr/job\n", root, "memory.max", "max"
    else:
        membership, base, name = "5:cpu:/ctr/job\n4:memory:/ctr/job\n", root / "memory", "memory.limit_in_bytes"
        unlimited = "9223372036854771712"  # v1's "no limit"
    (base / "ctr" / "job").mkdir(parents=True)
    (base / "ctr" / "job" / name).write_text(f"{unlimited}\n")
    (base / "ctr" / name).write_text(f"{limit}\n")
    (tmp_path / "proc-cgroup").write_text(membership)
    monkeypatch.setattr(errors, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(errors, "PROC_CGROUPS", str(tmp_path / "proc-cgroup"))
    return str(base / "ctr" / name)


@pytest.mark.parametrize("version", [1, 2])
def test_the_memory_check_takes_the_cgroup_limit(tmp_path, capsys, monkeypatch, version):
    """A 4 MiB limit refuses a dataset of a few MiB that half of this machine holds; "max" (v2) or v1's
    huge number mean no limit."""
    generate = ["generate", tmp_path / "g.parquet", "--records", "20", "--features", "20000"]
    limit_file = fake_cgroups(tmp_path, monkeypatch, version, 4 << 20)
    code, err = cli(capsys, *generate)
    assert code == 2 and "Traceback" not in err
    limit = f"more than half of the 4 MiB memory limit of this process's cgroup ({limit_file})"
    assert f"MiB in memory, {limit}" in err
    assert not (tmp_path / "g.parquet").exists()
    with open(limit_file, "w") as handle:
        handle.write("max\n" if version == 2 else "9223372036854771712\n")
    assert cli(capsys, *generate)[0] == 0


@pytest.mark.beam
@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_a_directrunner_bound_past_a_150_mib_limit_is_refused_before_it_starts(tmp_path, capsys, monkeypatch, version):
    """It ran, and the kernel killed it without a word (Beam's runner alone holds about 330 MiB)."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(20000))
    limit_file = fake_cgroups(tmp_path, monkeypatch, version, LIMIT)
    code, err = cli(capsys, "bound", data, tmp_path / "out", "-k", "3", *BEAM)
    assert code == 2 and "Traceback" not in err
    (line,) = madp_lines(err, "bound")
    assert line.startswith("madp bound: error: madp bound on the DirectRunner (in this process) holds about 330 MiB")
    assert f"more than half of the 150 MiB memory limit of this process's cgroup ({limit_file})" in line
    assert "raise the memory limit, or run it on a Beam cluster" in line
    assert not (tmp_path / "out" / "selected").exists()
    # Worker processes on this machine count; a runner elsewhere does not, and runs or fails there.
    workers = ["--direct_running_mode", "multi_processing", "--direct_num_workers", "2"]
    code, err = cli(capsys, "bound", data, tmp_path / "out", "-k", "3", *BEAM, *workers)
    assert code == 2 and "(in this process and 2 worker processes) holds about 930 MiB" in err


def own_memory_cgroup() -> str | None:
    """This process's memory cgroup directory, where a child of it can be made (v1 here)."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = os.path.join("/sys/fs/cgroup", controllers, path.strip("/"))
            return directory if os.access(directory, os.W_OK) else None
    return None


@pytest.mark.slow
def test_a_directrunner_bound_in_a_real_150_mib_cgroup_is_refused_not_killed(tmp_path):
    """The same in a real cgroup (v1's memory controller, where this machine lets a test make one):
    the process was OOM-killed (exit 137) as it imported Beam."""
    parent = own_memory_cgroup()
    if parent is None:
        pytest.skip("no writable cgroup v1 memory controller here")
    cgroup = os.path.join(parent, f"madp-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(cgroup)
        with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w") as handle:
            handle.write(str(LIMIT))
    except OSError as error:
        pytest.skip(f"cannot make a cgroup with a memory limit here: {error}")
    data = write_records(str(tmp_path / "d.jsonl"), rows(20000))
    try:
        done = subprocess.run(
            ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$0" "$@"', sys.executable, "-m", "madp.cli", "-q"]
            + ["bound", data, str(tmp_path / "out"), "-k", "3", "--runner", "DirectRunner"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=environment(),
            timeout=300,
        )
    finally:
        os.rmdir(cgroup)
    assert done.returncode == 2, (done.returncode, done.stderr)
    limit = f"more than half of the 150 MiB memory limit of this process's cgroup ({cgroup}/memory.limit_in_bytes)"
    assert limit in done.stderr


# --- Ctrl-C ---------------------------------------------------------------------------------------


@pytest.mark.beam
@pytest.mark.slow
def test_ctrl_c_during_a_beam_bound_is_one_line_and_exit_130(tmp_path):
    """SIGINT (Ctrl-C) in the middle of a DirectRunner bound printed a KeyboardInterrupt traceback."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(50000))
    output = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "madp.cli", "-q", "bound", data, str(output), "-k", "3", *BEAM],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=environment(),
    )
    deadline = time.monotonic() + 120
    while not (output / ".madp.lock").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # into the job: importing Beam, or running the pipeline
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert err.strip().splitlines() == [
        f"madp bound: interrupted: {output} is unfinished (no report.json, which is written last, so no madp "
        f"command reads it): run the command again"
    ]
    assert not (output / "report.json").exists() and not (output / ".madp.lock").exists()


@pytest.mark.tf
@pytest.mark.slow
def test_ctrl_c_during_training_names_its_checkpoint_and_resume_finishes_it(tmp_path, capsys, monkeypatch):
    """A KeyboardInterrupt traceback; the training's own handling (checkpoints, --resume) stays."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(1500))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")[0] == 0
    batch = ["--steps", "12", "--batch-size", "32", "--min-sep", "2", "--max-batch-size", "64", "--runner", "local"]
    assert cli(capsys, "batch", tmp_path / "b", data, tmp_path / "batches", *batch)[0] == 0
    out = tmp_path / "t"
    train = ["train", tmp_path / "batches", out, "--noise-multiplier", "1", "--bands", "2", "--checkpoint-every", "4"]
    crash_at(monkeypatch, 6)
    code, err = cli(capsys, *train)
    monkeypatch.undo()
    assert code == 130 and "Traceback" not in err
    assert madp_lines(err, "train") == [
        f"madp train: interrupted: {out} keeps the checkpoint of step 4: the same command with --resume "
        f"continues from it"
    ]
    assert not (out / "metrics.json").exists()
    code, err = cli(capsys, *train, "--resume")
    assert code == 0, err
    assert json.load(open(out / "metrics.json"))["resumed_at"] == 4


@pytest.mark.slow
def test_ctrl_c_during_madp_run_keeps_the_finished_stages(tmp_path, capsys, monkeypatch):
    """Interrupted in its batch stage, `madp run` printed a traceback; run again, it skips the stages
    that finished and runs the rest."""
    import yaml

    from madp.engines import batch_local

    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run_dir": str(tmp_path / "run"),
                "generate": {"records": 2000, "features": 4, "seed": 3},
                "bound": {"max_contributions": 2, "runner": "local"},
                "batch": {"steps": 10, "batch_size": 20, "min_sep": 2, "runner": "local"},
            }
        )
    )

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(batch_local, "run_local", interrupted)
    code, err = cli(capsys, "run", config)
    monkeypatch.undo()
    assert code == 130 and "Traceback" not in err
    assert madp_lines(err, "run") == [
        f"madp run: interrupted: the stages that finished are kept: `madp run {config}` again skips them and runs "
        f"the rest"
    ]
    assert main(["-q", "run", str(config)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {stage["stage"]: stage["status"] for stage in summary["stages"]} == {
        "generate": "skipped",
        "bound": "skipped",
        "verify-bound": "skipped",
        "batch": "ran",
        "verify-batches": "ran",
    }


# argv[1]: when the Ctrl-Cs come; the rest, a madp command whose bound is interrupted. "ended": one Ctrl-C once
# the command has ended, while the process waits for a thread of it (as Beam's and TensorFlow's outlive a
# command); "twice": a first one as it bounds, a second once it has ended; "cleanup": a first one as it bounds,
# a second as its clean-up releases the output's lock; "teardown": one as the interpreter tears down, after the
# exit functions (from an object's __del__ there, which says so on stderr once the Ctrl-C has not ended it).
LATE_CTRL_C = """
import os, signal, sys, threading, time
from madp import cli
from madp.core import storage
from madp.engines import local_engine
when, ended = sys.argv.pop(1), threading.Event()
bound_records, remove_file = local_engine.bound_records, storage.remove_file
def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
def outliving():
    ended.wait()
    ctrl_c()
    time.sleep(10)
def bounded(*args, **kwargs):
    if when in ("ended", "twice"):
        threading.Thread(target=outliving).start()
    if when in ("twice", "cleanup"):
        ctrl_c()
    return bound_records(*args, **kwargs)
def removed(path):
    if when == "cleanup" and path.endswith(".madp.lock"):
        ctrl_c()
    remove_file(path)
class CtrlCAtTeardown:
    def __del__(self, kill=os.kill, write=os.write, pid=os.getpid(), sigint=signal.SIGINT):
        kill(pid, sigint)
        write(2, b"still running after a Ctrl-C at teardown\\n")
local_engine.bound_records, storage.remove_file = bounded, removed
code = cli.main()
ended.set()
if when == "teardown":
    teardown = CtrlCAtTeardown()  # deleted as the interpreter clears this module, after the exit functions
sys.exit(code)
"""


@pytest.mark.parametrize("when", ["ended", "twice", "cleanup"])
def test_a_second_ctrl_c_or_one_after_the_end_is_no_traceback(tmp_path, when):
    """A Ctrl-C while the process waits for the threads of a command that has ended (a second one after the
    first stopped it, or one at the very end of a finished command) was a KeyboardInterrupt traceback, or an
    exit by the signal with no line; a second one during the first one's clean-up ends the process at once.
    Either way: the command's exit status and its one line, no traceback; a lock the clean-up had no time to
    remove is a killed process's, which the next run takes over."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    output = tmp_path / "out"
    command = ["-q", "bound", data, str(output), "-k", "2", "--runner", "local"]
    done = subprocess.run(
        [sys.executable, "-c", LATE_CTRL_C, when, *command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=environment(),
    )
    assert "Traceback" not in done.stderr, done.stderr
    if when == "ended":
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["selected_records"] == 100 and (output / "report.json").exists()
        assert not (output / ".madp.lock").exists()
        return
    assert done.returncode == 130, done.stderr
    assert madp_lines(done.stderr, "bound") == [
        f"madp bound: interrupted: {output} is unfinished (no report.json, which is written last, so no madp "
        f"command reads it): run the command again"
    ]
    assert not (output / "report.json").exists()
    assert (output / ".madp.lock").exists() == (when == "cleanup")
    again = subprocess.run(
        [sys.executable, "-m", "madp.cli", *command], capture_output=True, text=True, cwd=ROOT, env=environment()
    )
    assert again.returncode == 0, again.stderr
    assert (output / "report.json").exists() and not (output / ".madp.lock").exists()


@pytest.mark.parametrize(
    "runner", [pytest.param(["--runner", "local"], id="local"), pytest.param(BEAM, marks=pytest.mark.beam, id="beam")]
)
def test_a_ctrl_c_as_the_process_tears_down_leaves_the_finished_command_its_status(tmp_path, runner):
    """Once the exit functions have run, CPython gives SIGINT back its default action as it tears the
    interpreter down (longer with Beam loaded): a Ctrl-C there ended the finished command's process by the
    signal (exit status -2), with no line. It is ignored there: the command's own status and output."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    output = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", LATE_CTRL_C, "teardown", "-q", "bound", data, str(output), "-k", "2", *runner],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=environment(),
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "still running after a Ctrl-C at teardown" in done.stderr and "Traceback" not in done.stderr
    assert json.loads(done.stdout)["selected_records"] == 100 and (output / "report.json").exists()


@pytest.mark.beam
def test_a_ctrl_c_met_in_a_beam_step_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """The DirectRunner runs a step in this process, and re-raised the Ctrl-C it met there as a RuntimeError of
    its own: a traceback, not madp's line."""
    from madp.beam import bound

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bound, "_write_shard", interrupted)
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    output = tmp_path / "out"
    code, err = cli(capsys, "bound", data, output, "-k", "2", *BEAM)
    assert code == 130 and "Traceback" not in err, err
    assert madp_lines(err, "bound") == [
        f"madp bound: interrupted: {output} is unfinished (no report.json, which is written last, so no madp "
        f"command reads it): run the command again"
    ]
    assert not (output / ".madp.lock").exists()
