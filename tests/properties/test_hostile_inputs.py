"""Hostile and malformed inputs through the command line, on the local engine and on Beam: the
bound and the data never change under the verifiers, nothing is lost silently, and every bad input
is a clear error (exit 2) that names what is wrong, never a traceback."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import held_by, reseal_batches, write_records

from madp.cli import main
from madp.core import output_lock, storage
from madp.core.errors import InputError

ENGINES = {
    "local": ["--runner", "local"],
    "beam": ["--runner", "DirectRunner", "--direct_running_mode", "in_memory", "--partitions", "3"],
}
ENGINE_CASES = ["local", pytest.param("beam", marks=pytest.mark.beam)]


def cli(capsys, *args) -> tuple[int, dict | None, str]:
    code = main(["-q", *map(str, args)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def rows(count: int, users=lambda i: [i % 7, 100 + i % 5]) -> list[dict]:
    return [{"id": i, "users": users(i), "x": [float(i), 1.0], "label": i % 2} for i in range(count)]


def selected_ids(output) -> set:
    return set(pq.read_table(os.path.join(output, "selected")).column("id").to_pylist())


@pytest.mark.parametrize("engine", ENGINE_CASES)
def test_a_hidden_file_in_the_selection_is_refused_by_batch_and_the_verifier(tmp_path, capsys, engine):
    data = write_records(str(tmp_path / "d.jsonl"), rows(300))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", *ENGINES[engine])[0] == 0
    pq.write_table(
        pa.table({"id": pa.array(range(300), pa.int64()), "copies": pa.array([1] * 300, pa.int64())}),
        tmp_path / "b" / "selected" / ".extra.parquet",
    )
    code, _, err = cli(
        capsys, "batch", tmp_path / "b", data, tmp_path / "out", "--steps", "5", "--batch-size", "10", *ENGINES[engine]
    )
    assert code == 2 and "files the bound did not write ['.extra.parquet']" in err
    code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2")
    assert code == 1 and any(".extra.parquet is not a file the run wrote" in v for v in verdict["violations"])


def test_an_unfinished_bound_is_refused(tmp_path, capsys):
    """A killed bound leaves selection shards but no report (written last): nothing may consume them."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(200))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")[0] == 0
    os.remove(tmp_path / "b" / "report.json")
    code, _, err = cli(
        capsys,
        "batch",
        tmp_path / "b",
        data,
        tmp_path / "out",
        "--steps",
        "5",
        "--batch-size",
        "10",
        "--runner",
        "local",
    )
    assert code == 2 and "not a finished `madp bound` output" in err
    code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "2")
    assert code == 1 and "the run did not finish" in verdict["violations"][0]


@pytest.mark.tf
def test_a_changed_batch_file_is_refused_by_training_and_the_verifier(tmp_path, capsys):
    data = write_records(str(tmp_path / "d.jsonl"), rows(300))
    cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")
    assert (
        cli(
            capsys,
            "batch",
            tmp_path / "b",
            data,
            tmp_path / "out",
            "--steps",
            "5",
            "--batch-size",
            "10",
            "--runner",
            "local",
            "--output-shards",
            "2",
        )[0]
        == 0
    )
    shutil.copy(
        tmp_path / "out" / "batches-00000-of-00002.tfrecord", tmp_path / "out" / "batches-00009-of-00010.tfrecord"
    )
    code, verdict, _ = cli(
        capsys, "verify-batches", tmp_path / "out", data, "--min-sep", "1", "-k", "2", "--selected", tmp_path / "b"
    )
    assert code == 1 and "batches-00009-of-00010.tfrecord is not a file the run wrote" in verdict["violations"][0]
    pytest.importorskip("tensorflow")
    code, _, err = cli(capsys, "train", tmp_path / "out", tmp_path / "model", "--epsilon", "2")
    assert code == 2 and "files the batch did not write" in err


@pytest.mark.tf
def test_a_batch_file_cut_short_is_refused_before_training_starts(tmp_path, capsys):
    """A batch file cut inside a record, its listing rewritten to match (a faulty copy with a consistent
    report): TensorFlow's reader would stop the training halfway with a DataLossError, after it entered
    the trainings ledger; madp train refuses it by name before either."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(300))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")[0] == 0
    batch = ("--steps", "6", "--batch-size", "10", "--runner", "local", "--output-shards", "2")
    assert cli(capsys, "batch", tmp_path / "b", data, tmp_path / "out", *batch)[0] == 0
    path = tmp_path / "out" / "batches-00001-of-00002.tfrecord"
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])
    reseal_batches(tmp_path / "out")
    code, verdict, _ = cli(
        capsys, "verify-batches", tmp_path / "out", data, "--min-sep", "1", "-k", "2", "--selected", tmp_path / "b"
    )
    assert code == 1 and any("batches-00001-of-00002.tfrecord: unreadable" in v for v in verdict["violations"])
    pytest.importorskip("tensorflow")
    code, _, err = cli(capsys, "train", tmp_path / "out", tmp_path / "model", "--epsilon", "2", "--features", "x")
    assert code == 2 and f"{path}: the record at byte" in err and "cut short" in err, err
    assert not (tmp_path / "out" / "trainings.jsonl").exists() and not (tmp_path / "model" / "model.keras").exists()
    # A byte of a record's data changed: its checksum fails, and training refuses it the same way.
    changed = bytearray(whole)
    changed[20] ^= 1
    path.write_bytes(changed)
    reseal_batches(tmp_path / "out")
    code, _, err = cli(capsys, "train", tmp_path / "out", tmp_path / "model", "--epsilon", "2", "--features", "x")
    assert code == 2 and f"{path}: the record at byte 0 is damaged (its data fails its checksum)" in err, err


@pytest.mark.tf
def test_a_batch_row_unlike_its_schema_or_a_step_short_of_a_row_is_refused_before_training_starts(tmp_path, capsys):
    """The last row's label deleted, or the last row taken out, the checksums and the listing rewritten to
    match (a faulty copy with a consistent report): the first killed madp train mid-run with TensorFlow's
    traceback, after its ledger entry; the second trained on. madp train reads every step before its
    first: it refuses either by name before both; a Python loop meets the first as an error naming the file."""
    from conftest import rewrite_batches

    from madp.core.verify.tfrecords import _example_class, _feature_values, read_tfrecord

    data = write_records(str(tmp_path / "d.jsonl"), rows(300))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")[0] == 0
    batch = ("--steps", "6", "--batch-size", "10", "--runner", "local")
    assert cli(capsys, "batch", tmp_path / "b", data, tmp_path / "out", *batch)[0] == 0
    name = "batches-00000-of-00001.tfrecord"
    example = _example_class()
    steps = [_feature_values(example.FromString(p), "step")[0] for p in read_tfrecord(str(tmp_path / "out" / name))]
    last, held = len(steps) - 1, steps.count(steps[-1])

    def without_label(number, row) -> None:
        if number == last:
            del row.features.feature["label"]

    for damage in ("label", "row"):
        batches = tmp_path / f"without-{damage}"
        shutil.copytree(tmp_path / "out", batches)
        if damage == "label":
            rewrite_batches(batches, without_label)
        else:
            rewrite_batches(batches, lambda number, row: None, drop=last)
        model = tmp_path / f"model-{damage}"
        code, _, err = cli(capsys, "train", batches, model, "--epsilon", "2", "--features", "x")
        said = (
            f"{batches / name}: TensorFlow cannot read its rows as schema.json describes them (InvalidArgumentError: "
            f"Feature: label (data type: int64) is required but could not be found.)"
            if damage == "label"
            else f"{batches}: step {steps[-1]} holds {held - 1} rows where its report records {held}: not the batches"
        )
        assert code == 2 and said in err and "Traceback" not in err, err
        assert not (tmp_path / "b" / "trainings.jsonl").exists()
        assert not [path for path in model.rglob("*") if path.is_file()]
    from madp.training import open_batches, read_steps

    with pytest.raises(InputError, match=f"{tmp_path / 'without-label' / name}: TensorFlow cannot read its rows"):
        list(read_steps(open_batches(str(tmp_path / "without-label")), ["x", "label"]))


@pytest.mark.parametrize("engine", ENGINE_CASES)
def test_jsonl_content_stays_on_its_record(tmp_path, capsys, engine):
    """Arrow reads an object split over two lines, or two objects on one line, as records; the content
    reader counts lines. Such lines are rejected, so every batched row carries its own record's content."""
    lines = [json.dumps(r) for r in rows(60)]
    lines[3] = lines[3].replace(', "users"', ',\n "users"')  # record 3 split over two lines
    lines[10] = lines[10] + " " + lines[11]  # records 10 and 11 on one line
    del lines[11]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    code, report, _ = cli(capsys, "bound", data, tmp_path / "b", "-k", "9", "--on-invalid", "skip", *ENGINES[engine])
    assert code == 0 and report["rejected"] == {"invalid_json": 3} and report["input_records"] == 57
    assert (
        cli(
            capsys,
            "batch",
            tmp_path / "b",
            data,
            tmp_path / "out",
            "--steps",
            "20",
            "--batch-size",
            "20",
            "--on-invalid",
            "skip",
            "--seed",
            "1",
            *ENGINES[engine],
        )[0]
        == 0
    )
    from madp.core.verify.tfrecords import _example_class, _feature_values, read_tfrecord

    example = _example_class()
    batched = [example.FromString(p) for p in read_tfrecord(str(tmp_path / "out" / "batches-00000-of-00001.tfrecord"))]
    assert batched and all(_feature_values(e, "x")[0] == _feature_values(e, "id")[0] for e in batched)


@pytest.mark.parametrize("engine", ENGINE_CASES)
def test_capacities_match_user_ids_by_type_and_exact_text(tmp_path, capsys, engine):
    data = write_records(str(tmp_path / "d.jsonl"), rows(40, users=lambda i: [str(i % 10), f"x{i}"]))
    (tmp_path / "seven.csv").write_text("user,capacity\n7,0\n")
    (tmp_path / "padded.csv").write_text("user,capacity\n007,0\n")
    for name, capped in (("seven", True), ("padded", False)):
        capacities = tmp_path / f"{name}.csv"
        assert (
            cli(capsys, "bound", data, tmp_path / name, "-k", "4", "--capacities", capacities, *ENGINES[engine])[0] == 0
        )
        assert (7 in selected_ids(tmp_path / name)) is not capped
        code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / name, "-k", "4", "--capacities", capacities)
        assert code == 0 and verdict["ok"]
    (tmp_path / "typed.jsonl").write_text('{"user": 7, "capacity": 0}\n')
    code, _, err = cli(
        capsys,
        "bound",
        data,
        tmp_path / "typed",
        "-k",
        "4",
        "--capacities",
        tmp_path / "typed.jsonl",
        "--runner",
        "local",
    )
    assert code == 2 and "same id type" in err


def test_a_folder_the_lock_made_goes_with_it_where_the_command_left_it_empty(tmp_path):
    made, kept, existing = (str(tmp_path / name) for name in ("made", "kept", "existing"))
    with pytest.raises(InputError), output_lock.exclusive(made, "bound"):
        raise InputError("refused before writing")
    with output_lock.exclusive(kept, "bound"):
        open(os.path.join(kept, "report.json"), "w").close()
    os.makedirs(existing)
    with output_lock.exclusive(existing, "bound"):
        pass
    assert not os.path.exists(made) and os.listdir(kept) == ["report.json"] and os.listdir(existing) == []


def test_a_writer_takes_the_lock_of_a_folder_another_removed_as_it_took_it(tmp_path, monkeypatch):
    """The folder is removed, empty, by a writer that made it (leaving) between the makedirs and the lock of
    another: that one makes it again and takes the lock."""
    output, create_whole = str(tmp_path / "out"), output_lock._create_whole

    def after_the_folder_went(path: str, text: str) -> None:
        monkeypatch.setattr(output_lock, "_create_whole", create_whole)
        os.rmdir(output)
        create_whole(path, text)

    monkeypatch.setattr(output_lock, "_create_whole", after_the_folder_went)
    with output_lock.exclusive(output, "bound"):
        assert output_lock.holds(output)


def test_a_lock_is_held_by_the_thread_that_took_it(tmp_path):
    """What the lock guards (the trainings ledger) is read and written by whoever `holds` it: another
    thread of the same process does not, so it takes the lock itself and is refused while it is held."""
    import threading

    folder = str(tmp_path / "batches")
    seen = {}

    def other_thread():
        seen["holds"] = output_lock.holds(folder)
        try:
            with output_lock.exclusive(folder, "another thread"):
                seen["took"] = True
        except output_lock.OutputLocked:
            seen["took"] = False

    assert not output_lock.holds(folder)
    with output_lock.exclusive(folder, "train"):
        assert output_lock.holds(folder)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen == {"holds": False, "took": False} and not output_lock.holds(folder)


@pytest.fixture
def object_store(tmp_path, monkeypatch) -> None:
    """mock://: the test's folder as an object store, read and written through madp's remote code; its
    listings drop the host, as pyarrow's of hdfs:// do."""
    import pyarrow.fs as pafs

    resolve = storage._resolve
    bucket = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())

    def mock_resolve(path: str):
        if not path.startswith("mock://"):
            return resolve(path)
        parts = path[len("mock://") :].split("/")
        return bucket, "/".join(parts[1:] if ":" in parts[0] else parts)  # host:port dropped

    monkeypatch.setattr(storage, "_resolve", mock_resolve)


def test_two_writers_of_a_remote_output_started_at_once_never_both_hold_it(tmp_path, monkeypatch, object_store):
    """On an object store the lock is taken by claims: two writers whose checks both find no lock never
    hold it at once, which the check-then-write taking allowed (both then read the trainings ledger
    before either entered it). A claim left by a killed writer refuses the next one by name, and a
    content digest does not see claims."""
    import threading
    import time

    kind = storage.kind
    folder = "mock://namenode:8020/bucket/batches"
    both_looked, first_looks = threading.Barrier(2), set()

    def looked(path: str) -> str:
        found = kind(path)
        if path == f"{folder}/{storage.LOCK_FILE}" and threading.get_ident() not in first_looks:
            first_looks.add(threading.get_ident())
            both_looked.wait(timeout=30)  # both find no lock before either goes on
        return found

    monkeypatch.setattr(storage, "kind", looked)
    holding, most, refused, counting = [0], [0], [], threading.Lock()

    def writer(command: str) -> None:
        try:
            with output_lock.exclusive(folder, command):
                with counting:
                    holding[0] += 1
                    most[0] = max(most[0], holding[0])
                time.sleep(0.5)  # still held while the other lists the claims
                with counting:
                    holding[0] -= 1
        except output_lock.OutputLocked as error:
            refused.append(str(error))

    threads = [threading.Thread(target=writer, args=(command,)) for command in ("train", "train (a sweep)")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    monkeypatch.setattr(storage, "kind", kind)
    assert most[0] == 1, (most, refused)
    assert all("madp process" in error for error in refused)
    assert os.listdir(tmp_path / "bucket" / "batches") == []  # every claim withdrawn or released
    (tmp_path / "bucket" / "batches" / "steps.txt").write_text("1")
    free = storage.content_digest(folder)
    with output_lock.exclusive(folder, "train"):
        assert storage.content_digest(folder) == free  # what a reader reads: not the lock nor its claim
        with pytest.raises(output_lock.OutputLocked, match="`madp train`"):
            with output_lock.exclusive(folder, "train (a sweep)"):
                pass
    (tmp_path / "bucket" / "batches" / f"{output_lock.CLAIM_PREFIX}killed").write_text(
        json.dumps({"pid": 1, "host": "elsewhere", "command": "train", "since": "then"})
    )
    monkeypatch.setattr(output_lock.random, "uniform", lambda low, high: 0.001)  # the waits between tries
    with pytest.raises(output_lock.OutputLocked, match=f"{folder}/{output_lock.CLAIM_PREFIX}killed.*remove it"):
        with output_lock.exclusive(folder, "train"):
            pass
    assert sorted(os.listdir(tmp_path / "bucket" / "batches")) == [f"{output_lock.CLAIM_PREFIX}killed", "steps.txt"]


def test_a_second_writer_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, capsys):
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    (tmp_path / "b").mkdir()  # kept after the first writer's lock: a folder it did not make
    with output_lock.exclusive(str(tmp_path / "b"), "bound (another run)"):
        code, _, err = cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")
        assert code == 2 and "being written by another madp process" in err and "bound (another run)" in err
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "b" / storage.LOCK_FILE).write_text(
        json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename, "command": "bound", "since": "then"})
    )
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")[0] == 0
    assert not (tmp_path / "b" / storage.LOCK_FILE).exists()
    (tmp_path / "file").write_text("")
    code, _, err = cli(capsys, "bound", data, tmp_path / "file", "-k", "2", "--runner", "local")
    assert code == 2 and "is a file" in err


def test_a_link_into_a_folder_another_process_holds_is_refused(tmp_path, capsys, other_process):
    """OUTPUT given as a link to a stage folder of a running `madp run`: the folders above the link's
    target hold a lock that counts, as do those above the link (one inside the run's folder)."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(100))
    run_dir = tmp_path / "run"
    (run_dir / "bound").mkdir(parents=True)
    (run_dir / storage.LOCK_FILE).write_text(held_by(other_process, "run job.yaml"))
    os.symlink(run_dir / "bound", tmp_path / "link")
    code, _, err = cli(capsys, "bound", data, tmp_path / "link", "-k", "2", "--runner", "local")
    assert code == 2 and "being written by another madp process" in err and f"pid {other_process}" in err
    assert os.listdir(run_dir / "bound") == []
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", run_dir / "stage")  # a link inside the run's folder, to another one
    code, _, err = cli(capsys, "bound", data, run_dir / "stage", "-k", "2", "--runner", "local")
    assert code == 2 and "being written by another madp process" in err
    assert os.listdir(tmp_path / "elsewhere") == []


@pytest.mark.tf
def test_a_training_never_reads_batches_while_they_are_rewritten(tmp_path, capsys, other_process):
    """A training reads the batch files a report lists; `madp batch` into the same folder rewrites them.
    A writer of another process holding the folder refuses the readers (a non-private `madp train`, which
    takes no lock of its own, and the Python API); a reader's mark refuses a `madp batch` of another
    process; and batches rewritten between opening and reading them are refused, never read as a mix."""
    pytest.importorskip("tensorflow")
    from madp.training import open_batches, read_steps

    data = write_records(str(tmp_path / "d.jsonl"), rows(300))
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")[0] == 0
    out = tmp_path / "out"
    batch = ["batch", tmp_path / "b", data, out, "--steps", "5", "--batch-size", "10", "--runner", "local"]
    assert cli(capsys, *batch)[0] == 0
    (out / storage.LOCK_FILE).write_text(held_by(other_process, "batch"))
    code, _, err = cli(capsys, "train", out, tmp_path / "model", "--mechanism", "none", "--features", "x")
    assert code == 2 and "being written by another madp process" in err
    with pytest.raises(InputError, match="being written by another madp process"):
        open_batches(str(out))
    (out / storage.LOCK_FILE).unlink()

    steps = read_steps(open_batches(str(out)), ["x", "label"])
    next(steps)  # reading
    writer = subprocess.run(
        [sys.executable, "-m", "madp.cli", "-q", *map(str, batch)], capture_output=True, text=True, timeout=300
    )
    assert writer.returncode == 2 and "is being read by another madp process" in writer.stderr, writer.stderr
    assert len(list(steps)) == 4  # the other steps, of the same batches
    assert [name for name in os.listdir(out) if name.startswith(storage.LOCK_FILE)] == []  # the mark is gone

    opened = open_batches(str(out))
    assert cli(capsys, *batch)[0] == 0  # a fresh secret sampling: other rows
    with pytest.raises(InputError, match="rewritten since"):
        next(read_steps(opened, ["x", "label"]))


@pytest.mark.parametrize("engine", ENGINE_CASES)
def test_malformed_jsonl_and_repeated_files_are_counted_not_crashes(tmp_path, capsys, engine):
    (tmp_path / "null.jsonl").write_text("null\n" + "".join(json.dumps(r) + "\n" for r in rows(30)))
    code, _, err = cli(capsys, "bound", tmp_path / "null.jsonl", tmp_path / "b1", "-k", "2", *ENGINES[engine])
    assert code == 2 and "row 0: invalid_json" in err
    code, report, _ = cli(
        capsys, "bound", tmp_path / "null.jsonl", tmp_path / "b2", "-k", "2", "--on-invalid", "skip", *ENGINES[engine]
    )
    assert code == 0 and report["rejected"] == {"invalid_json": 1} and report["input_records"] == 30
    twice = tmp_path / "twice"
    twice.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        shutil.copy(tmp_path / "null.jsonl", twice / name)
    code, report, _ = cli(capsys, "bound", twice, tmp_path / "b3", "-k", "2", "--on-invalid", "skip", *ENGINES[engine])
    assert (
        code == 0 and report["rejected"] == {"invalid_json": 2, "duplicate_id": 60} and report["selected_records"] == 0
    )


def test_the_verifiers_read_what_the_engines_skip(tmp_path, capsys):
    lines = [
        b'\xef\xbb\xbf{"id": 0, "users": [1]}',
        b'{"id": [1], "users": [1]}',
        b'{"id": 2, "users": [[2]]}',
        b'{"id": 3, "users": [3], "x": "\xff"}',
        b"\xff\xfe{",
        b'{"id": 5, "users": [5]}',
    ]
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    code, report, _ = cli(capsys, "bound", data, tmp_path / "b", "-k", "1", "--on-invalid", "skip", "--runner", "local")
    assert code == 0 and selected_ids(tmp_path / "b") == {0, 5}
    code, verdict, _ = cli(capsys, "verify-bound", data, tmp_path / "b", "-k", "1")
    assert code == 0 and verdict["ok"], verdict


def test_misspelled_options_are_errors_not_beam_options(tmp_path, capsys):
    data = write_records(str(tmp_path / "d.jsonl"), rows(30))
    code, _, err = cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--ordr", "hash")
    assert code == 2 and "unrecognized option(s) --ordr" in err
    cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--runner", "local")
    code, _, err = cli(
        capsys, "batch", tmp_path / "b", data, tmp_path / "out", "--steps", "5", "--batch-size", "5", "--min_sep", "4"
    )
    assert code == 2 and "unrecognized option(s) --min_sep" in err


@pytest.mark.beam
def test_string_ids_on_beam_give_string_typed_empty_shards(tmp_path, capsys):
    data = write_records(str(tmp_path / "d.jsonl"), [{"id": f"r{i}", "users": [i]} for i in range(2)])
    assert cli(capsys, "bound", data, tmp_path / "b", "-k", "1", "--output-shards", "4", *ENGINES["beam"])[0] == 0
    shards = sorted((tmp_path / "b" / "selected").iterdir())
    assert len(shards) == 4 and {pq.read_schema(s).field("id").type for s in shards} == {pa.string()}
    assert (
        cli(
            capsys,
            "batch",
            tmp_path / "b",
            data,
            tmp_path / "out",
            "--steps",
            "3",
            "--batch-size",
            "1",
            "--runner",
            "local",
        )[0]
        == 0
    )


def test_input_files_by_suffix_and_mbox_edges(tmp_path, capsys):
    directory = tmp_path / "in"
    directory.mkdir()
    with gzip.open(directory / "a.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows(20))
    write_records(str(directory / "b.jsonl"), [{**r, "id": r["id"] + 100} for r in rows(20)])
    (directory / "c.JSONL").write_text("")
    code, report, _ = cli(capsys, "bound", directory, tmp_path / "b", "-k", "9", "--runner", "local")
    assert code == 0 and report["input_records"] == 40
    assert [os.path.basename(f) for f in report["ignored_files"]] == ["c.JSONL"]
    eml = tmp_path / "one.eml"
    eml.write_text("From: a@example.com\nTo: b@example.com\nSubject: hi\n\nbody\n")
    code, _, err = cli(capsys, "import-mbox", eml, tmp_path / "mail")
    assert code == 2 and "no message" in err
    box = tmp_path / "box.mbox"
    box.write_text(
        "stray text\n\nFrom a@example.com Thu Jan  1 00:00:00 1970\nFrom: a@example.com\n"
        "To: b@example.com\nSubject: hi\n\nbody\n"
    )
    code, report, _ = cli(capsys, "import-mbox", box, tmp_path / "mail2")
    assert code == 0 and report["records"] == 1 and report["skipped"] == {"text_before_first_message": 1}
    assert "stray text" in (tmp_path / "mail2" / "rejected.jsonl").read_text()


@pytest.mark.parametrize("engine", ENGINE_CASES)
def test_bad_files_and_outputs_are_clear_errors(tmp_path, capsys, engine):
    data = write_records(str(tmp_path / "d.parquet"), rows(50))
    truncated = tmp_path / "t.parquet"
    truncated.write_bytes(open(data, "rb").read()[:300])
    code, _, err = cli(capsys, "bound", truncated, tmp_path / "b", "-k", "2", *ENGINES[engine])
    assert code == 2 and "t.parquet: not a readable Parquet file" in err
    storage.write_parquet(pa.Table.from_pylist(rows(50)), str(tmp_path / "c.parquet"))  # as madp writes Parquet
    flipped = bytearray(open(tmp_path / "c.parquet", "rb").read())
    ids = pq.ParquetFile(tmp_path / "c.parquet").metadata.row_group(0).column(0)
    flipped[(ids.dictionary_page_offset or ids.data_page_offset) + ids.total_compressed_size - 5] ^= 0xFF  # in a page
    (tmp_path / "f.parquet").write_bytes(bytes(flipped))
    code, _, err = cli(capsys, "bound", tmp_path / "f.parquet", tmp_path / "b", "-k", "2", "--runner", "local")
    assert code == 2 and "f.parquet: not a readable Parquet file" in err
    (tmp_path / "empty.csv").write_text("")
    code, _, err = cli(
        capsys, "bound", data, tmp_path / "b", "-k", "2", "--capacities", tmp_path / "empty.csv", *ENGINES[engine]
    )
    assert code == 2 and "empty.csv: not a readable capacities file" in err
    (tmp_path / "zero.csv").write_text(
        "user,capacity\n" + "".join(f"{u},0\n" for u in list(range(7)) + list(range(100, 105)))
    )
    assert (
        cli(capsys, "bound", data, tmp_path / "b", "-k", "2", "--capacities", tmp_path / "zero.csv", *ENGINES[engine])[
            0
        ]
        == 0
    )
    code, _, err = cli(
        capsys, "batch", tmp_path / "b", data, tmp_path / "out", "--steps", "5", "--batch-size", "2", *ENGINES[engine]
    )
    assert code == 2 and "nothing to batch" in err


@pytest.mark.parametrize("value", [float("nan"), 1e39])
def test_nan_features_stop_batching_with_the_record_named(tmp_path, capsys, value):
    """NaN, and a value finite in the JSON but beyond float32's range, which the batches (float32)
    would hold as infinite: one record would turn the released model to NaN."""
    data = write_records(str(tmp_path / "d.jsonl"), [{**r, "x": [value, 1.0]} if r["id"] == 4 else r for r in rows(30)])
    cli(capsys, "bound", data, tmp_path / "b", "-k", "9", "--runner", "local")
    code, _, err = cli(
        capsys,
        "batch",
        tmp_path / "b",
        data,
        tmp_path / "out",
        "--steps",
        "5",
        "--batch-size",
        "5",
        "--runner",
        "local",
    )
    assert code == 2 and "holds a NaN, infinite or beyond-float32 value for selected record 4" in err


def test_every_seed_is_an_integer_in_0_to_2_to_the_64(tmp_path, capsys):
    """A negative seed was a numpy traceback, one of 2^64 or more reproduced a smaller one's draws: both
    are refused by name, on the command line and in a `madp run` config."""
    data = write_records(str(tmp_path / "d.jsonl"), rows(30))
    refused = [
        ("generate", tmp_path / "g", "--records", "10", "--seed", "-1"),
        ("bound", data, tmp_path / "b", "-k", "2", "--seed", str(2**64)),
        ("train", tmp_path / "b", tmp_path / "t", "--noise-seed", "abc"),
        ("epsilon", "--mechanism", "dpsgd", "--delta", "1e-6", "--steps", "5", "--sampling-prob", "0.1"),
    ]
    refused[-1] += ("--noise-multiplier", "1", "--seed", "-3")
    for args in refused:
        with pytest.raises(SystemExit) as stopped:  # argparse's usage error
            main(["-q", *map(str, args)])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and "a seed is an integer in [0, 2^64)" in err and "Traceback" not in err
    config = {
        "run_dir": str(tmp_path / "run"),
        "generate": {"records": 50, "seed": -1},
        "bound": {"max_contributions": 2},
    }
    (tmp_path / "job.yaml").write_text(json.dumps(config))
    code, _, err = cli(capsys, "run", tmp_path / "job.yaml")
    assert code == 2 and "config generate.seed: a seed is an integer in [0, 2^64), got -1" in err


def test_a_synthetic_dataset_beyond_memory_or_shards_beyond_its_records_is_refused(tmp_path, capsys):
    """generate allocated first and was killed (or raised numpy's MemoryError); a shard per record at
    most, since more wrote empty files, and before anything is written."""
    for option, value in (("--features", 10**9), ("--mean-arity", 1e9)):
        code, _, err = cli(capsys, "generate", tmp_path / "g", "--records", 20, option, value)
        assert code == 2 and "GiB in memory, more than half of " in err and "Traceback" not in err
    code, _, err = cli(capsys, "generate", tmp_path / "g", "--records", 20, "--shards", 21)
    assert code == 2 and "--shards must be between 1 and --records (20)" in err
    assert not list((tmp_path / "g").glob("*.parquet"))
    assert cli(capsys, "generate", tmp_path / "g", "--records", 20, "--shards", 20)[0] == 0


def test_zero_monte_carlo_samples_are_refused_not_read_as_the_default(capsys):
    args = ["epsilon", "--mechanism", "bandmf-minsep", "--delta", "1e-6", "--steps", "100", "--min-sep", "5"]
    args += ["--bands", "2", "--sampling-prob", "0.01", "--noise-multiplier", "2", "--samples", "0"]
    code, _, err = cli(capsys, *args)
    assert code == 2 and "0 samples cannot verify delta 1e-06" in err


def test_run_configs_and_damaged_manifests(tmp_path, capsys):
    import yaml

    config = {
        "run_dir": str(tmp_path / "run"),
        "generate": {"records": 500, "features": 2, "seed": 1},
        "bound": {"runner": "local"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    code, _, err = cli(capsys, "run", tmp_path / "job.yaml")
    assert code == 2 and "config bound.max_contributions: required" in err
    config["bound"]["max_contributions"] = 2
    config["generate"].pop("records")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    code, _, err = cli(capsys, "run", tmp_path / "job.yaml")
    assert code == 2 and "config generate:" in err and "--records" in err
    config["generate"]["records"] = 500
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    assert cli(capsys, "run", tmp_path / "job.yaml")[0] == 0
    (tmp_path / "run" / ".madp" / "bound.json").write_text('{"stage": "bo')
    code, summary, _ = cli(capsys, "run", tmp_path / "job.yaml")
    assert code == 0 and {s["stage"]: s["status"] for s in summary["stages"]}["bound"] == "ran"


def test_a_record_with_the_padding_id_is_refused(tmp_path, capsys):
    data = write_records(str(tmp_path / "d.jsonl"), [{**r, "id": r["id"] - 1} for r in rows(30)])  # ids -1..28
    cli(capsys, "bound", data, tmp_path / "b", "-k", "9", "--runner", "local")
    code, _, err = cli(
        capsys,
        "batch",
        tmp_path / "b",
        data,
        tmp_path / "out",
        "--steps",
        "5",
        "--batch-size",
        "5",
        "--runner",
        "local",
    )
    assert code == 2 and "selected record id -1 is the id of padding rows" in err


def test_content_columns_come_from_every_row_and_huge_samplings_are_refused(tmp_path, capsys):
    records = rows(30)
    for record in records[:5]:
        del record["x"]  # the first rows lack a column the later ones have
    records[0]["note"] = "only here"
    data = write_records(str(tmp_path / "d.jsonl"), records[5:] + records[:5])
    (tmp_path / "first.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    from madp.core.record_reading import content_columns
    from madp.core.records import Columns

    assert content_columns(str(tmp_path / "first.jsonl"), Columns()) == ("label", "note", "x")
    cli(capsys, "bound", data, tmp_path / "b", "-k", "9", "--runner", "local")
    code, _, err = cli(
        capsys,
        "batch",
        tmp_path / "b",
        data,
        tmp_path / "out",
        "--steps",
        str(10**9),
        "--batch-size",
        "20",
        "--content-columns",
        "label",
        "--runner",
        "local",
    )
    assert code == 2 and "more than half of " in err


def test_an_empty_parquet_file_is_named(tmp_path, capsys):
    (tmp_path / "empty.parquet").write_bytes(b"")
    code, _, err = cli(capsys, "bound", tmp_path / "empty.parquet", tmp_path / "b", "-k", "2", "--runner", "local")
    assert code == 2 and "empty.parquet: not a readable Parquet file" in err


def test_a_training_replaced_on_an_object_store_is_set_aside_and_put_back(object_store, monkeypatch):
    """Where a file is moved by a copy and a delete: a --replace training's earlier training goes to
    internal/replaced/ and comes back byte for byte, the new training's files gone; stopped between a copy
    and its delete (privacy.json in both places), it comes back whole too."""
    from madp.training.outputs import set_aside, settle_replaced, written_by_training

    output = "mock://bucket/train"
    earlier = {"model.keras": "model", "privacy.json": "{}", "logs/events.out.tfevents.0000000000.madp": "old"}
    for relative, text in earlier.items():
        storage.write_text(f"{output}/{relative}", text)
    set_aside(output, storage.written_files(output, written_by_training, "madp train"))
    assert storage.kind(f"{output}/model.keras") == "missing"
    storage.write_text(f"{output}/logs/events.out.tfevents.0000000000.madp", "new")
    storage.write_text(f"{output}/metrics.json", "{}")
    assert settle_replaced(output) == "restored"
    held = {storage.below(output, path): storage.read_text(path) for path in storage.list_files(output)}
    assert held == earlier

    move = storage.move_below  # stopped between the copy of privacy.json and the delete of the original

    def stopped_after_a_copy(source, target, relatives):
        move(source, target, [relative for relative in relatives if relative != "privacy.json"])
        storage.write_text(f"{target}/privacy.json", storage.read_text(f"{source}/privacy.json"))
        raise KeyboardInterrupt

    monkeypatch.setattr(storage, "move_below", stopped_after_a_copy)
    with pytest.raises(KeyboardInterrupt):
        set_aside(output, storage.written_files(output, written_by_training, "madp train"))
    monkeypatch.setattr(storage, "move_below", move)
    assert settle_replaced(output) == "restored"
    held = {storage.below(output, path): storage.read_text(path) for path in storage.list_files(output)}
    assert held == earlier
