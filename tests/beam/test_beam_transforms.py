"""The Beam transforms on their own, in a TestPipeline with assert_that: building both sides of the
bounding from files (counts and rejects as PCollections), rounds of Alg. 1 against the in-memory
engine's rounds on the same graph, the whole bounding embedded in a pipeline of one's own, the
bounding and the batching chained in one; and bad input met by a step, carried to the driver as data."""

from __future__ import annotations

import glob

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pytest
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.typehints.decorators import TypeCheckError
from conftest import write_records
from test_batching import rows_of

from madp.beam import files
from madp.beam.bound_build import BuildSides
from madp.beam.bound_contributions import BoundContributions
from madp.beam.bound_rounds import FirstSaturation, Iteration, Progress, round_stat
from madp.beam.min_sep_sample import MinSepSample
from madp.beam.pipeline import keeping_input_errors, pipeline_options, run
from madp.beam.record_chunks import ReadRecords, RecordExtractors, RecordsFromRows
from madp.core import record_reading
from madp.core.batch_files import Feature
from madp.core.bounding import Capacities, Control
from madp.core.errors import InputError
from madp.core.graph_digest import GraphDigest, graph_digest
from madp.core.records import Columns, Rejects
from madp.core.selection import BoundOptions
from madp.engines import batch_local
from madp.engines.batching import BatchOptions
from madp.engines.local_engine import bound_records, read_input
from madp.engines.local_engine import run_local as bound_local

pytestmark = [pytest.mark.beam]


def _test_pipeline() -> BeamTestPipeline:
    return BeamTestPipeline(options=pipeline_options(["--direct_running_mode=in_memory", "--direct_num_workers=1"]))


def _totals(stats):
    """The per-name totals of (name, count) stats as one dict."""
    return stats | "SumByName" >> beam.CombinePerKey(sum) | "AsDict" >> beam.combiners.ToDict()


def test_build_sides_counts_and_rejects_rows_as_data(tmp_path):
    first = write_records(
        str(tmp_path / "a.jsonl"), [{"id": 1, "users": [1, 2]}, {"id": 2, "users": []}, {"id": 3, "users": [2, 2]}]
    )
    second = write_records(str(tmp_path / "b.jsonl"), [{"id": 3, "users": [4]}, {"id": 4, "users": [5]}])
    options = BoundOptions(max_contributions=1)

    def digest_of_counts(totals: dict) -> dict:  # the graph digest's summed counts as the digest they make
        sizes = ("graph_digest_", "round_00000_shuffled", "max_user_partition_bytes")  # bytes: not counted here
        kept = {n: v for n, v in totals.items() if not n.startswith(sizes)}
        return {**kept, "graph_digest": GraphDigest.from_counts(totals).hex}

    with _test_pipeline() as pipeline:
        chunks, read_rejects, read_stats = pipeline | ReadRecords([first, second], options.columns)
        users, records, rejects, _, stats = chunks | BuildSides(options, 3, None, None, None)
        assert_that(
            _totals((read_stats, stats) | "AllStats" >> beam.Flatten()) | "Digest" >> beam.Map(digest_of_counts),
            equal_to(
                [
                    {
                        "input_rows": 5,
                        "rejected_empty_users": 1,
                        "rejected_duplicate_id": 2,  # id 3, in both files: both rows go
                        "repeated_users_removed": 1,
                        "input_records": 2,
                        "input_users": 3,
                        "users_with_input_records_000000001": 3,
                        "built_incidences": 3,
                        "certified_dropped_records": 0,
                        # Summed over partitions, the graph of the records kept: 1 (users 1, 2) and 4 (user 5).
                        "graph_digest": graph_digest(pa.array([4, 1]), np.array([0, 1, 3]), pa.array([5, 2, 1])).hex,
                    }
                ]
            ),
            label="Counts",
        )
        reasons = (read_rejects, rejects) | "AllRejects" >> beam.Flatten() | beam.FlatMap(lambda batch: batch.reason)
        assert_that(reasons, equal_to(["empty_users", "duplicate_id", "duplicate_id"]), label="Rejects")


def test_rounds_select_what_the_in_memory_engine_selects_round_by_round(tmp_path):
    rng = np.random.default_rng(6)  # a graph that takes 3 rounds
    rows = [{"id": i, "users": sorted(set(rng.integers(0, 60, rng.integers(1, 5)).tolist()))} for i in range(300)]
    path = write_records(str(tmp_path / "records.jsonl"), rows)
    options = BoundOptions(max_contributions=2)
    chunk, _, _, _ = read_input(path, Columns())
    local = bound_records(chunk, options, Capacities(2)).rounds
    assert len(local) >= 3
    control = Control(duplicates=False, max_rounds=None)
    with _test_pipeline() as pipeline:
        chunks, _, _ = pipeline | ReadRecords([path], options.columns)
        users, _, _, counts, _ = chunks | BuildSides(options, 4, None, None, None)
        start = pipeline | "Start" >> beam.Create([Progress(control)])
        # threshold 0: never finished locally; the first saturation retires the certified records
        users, progress, _ = (users, counts, start) | FirstSaturation(control, threshold=0, saturate=True)
        round_stats = []
        for index in (1, 2, 3):
            users, progress, _, _, stats = (users, progress) | f"Round{index}" >> Iteration(index, False, 0)
            round_stats.append(stats)
        counts = (
            tuple(round_stats) | beam.Flatten() | beam.Filter(lambda stat: stat[0].endswith(("_selected", "_eligible")))
        )
        expected = {}
        for index, one in enumerate(local[:3], 1):
            expected[round_stat(index, "selected")] = one.selected
            expected[round_stat(index, "eligible")] = one.eligible
        assert_that(_totals(counts), equal_to([expected]), label="Counts")
        rounds = progress | beam.Map(lambda last: list(last.control.per_round))
        assert_that(rounds, equal_to([local[:3]]), label="Control")


def test_bound_contributions_embed_in_a_pipeline_of_ones_own(tmp_path):
    """Records made in the pipeline (not read by madp), selected by the composite transform: the
    in-memory engine's selection, as (shard, table) elements a pipeline writes where it wants."""
    rng = np.random.default_rng(8)
    rows = [{"id": 10 * i, "users": sorted(set(rng.integers(0, 50, rng.integers(1, 4)).tolist()))} for i in range(250)]
    path = write_records(str(tmp_path / "records.jsonl"), rows)
    chunk = record_reading.read_file(path, 0, Columns()).chunk
    options = BoundOptions(max_contributions=2, output_shards=2)
    local = bound_records(chunk, options, Capacities(2))
    expected = [(int(i), int(c)) for i, c in zip(chunk.ids.to_pylist(), local.copies) if c > 0]
    with _test_pipeline() as pipeline:
        bound = pipeline | beam.Create([(0, chunk)]) | BoundContributions(options, partitions=3)
        pairs = bound.shards | beam.FlatMapTuple(
            lambda _, table: zip(table["id"].to_pylist(), table["copies"].to_pylist())
        )
        assert_that(pairs, equal_to(expected), label="Selection")
        assert_that(bound.shards | beam.Keys() | beam.Distinct(), equal_to([0, 1]), label="Shards")
        assert_that(bound.rejects, equal_to([]), label="NoRejects")
        rounds = bound.control | beam.Map(lambda control: (list(control.per_round), control.converged))
        assert_that(rounds, equal_to([(local.rounds, True)]), label="Rounds")


def test_bounding_and_batching_chain_in_one_pipeline_of_ones_own(tmp_path):
    """Records made in the pipeline, bounded by BoundContributions and sampled by MinSepSample in the
    same run (p calibrated in the graph): each batch file gets the rows, step by step, that the
    in-memory engines write for the same records bounded, then batched."""
    rng = np.random.default_rng(9)
    rows = [
        {"id": 10 * i, "users": sorted(set(rng.integers(0, 60, rng.integers(1, 4)).tolist())), "x": float(i)}
        for i in range(300)
    ]
    path = write_records(str(tmp_path / "records.jsonl"), rows)
    bound_options = BoundOptions(max_contributions=2)
    bound_local(path, str(tmp_path / "bounded"), bound_options)
    options = BatchOptions(seed=4, steps=30, batch_size=12, min_sep=2, output_shards=2)
    local = batch_local.run_local(str(tmp_path / "bounded"), path, str(tmp_path / "batches"), options)
    expected = [(row["step"][0], row["id"][0]) for row in rows_of(str(tmp_path / "batches"))]
    chunk = record_reading.read_file(path, 0, Columns(), ("x",)).chunk
    with _test_pipeline() as pipeline:
        chunks = pipeline | beam.Create([(0, chunk)])
        selection = (chunks | BoundContributions(bound_options, partitions=3)).shards
        sampled = (chunks, selection) | MinSepSample(options, 3)
        pairs = sampled.rows | beam.FlatMapTuple(lambda _, rows: zip(rows.steps.tolist(), rows.ids.to_pylist()))
        assert_that(pairs, equal_to(expected), label="Rows")
        assert_that(sampled.rows | beam.Keys(), equal_to([0, 1]), label="EveryFile")
        probability = sampled.stats | beam.Filter(lambda stat: stat[0] == "probability") | beam.Values()
        assert_that(probability, equal_to([local.sampling_probability]), label="P")
        assert_that(sampled.content, equal_to([{"x": Feature("x", "float", ())}]), label="Content")
        assert_that(sampled.rejects, equal_to([]), label="NoRejects")


def test_elements_of_the_wrong_type_are_refused_when_the_graph_is_built(tmp_path):
    """The composite transforms declare their element types, and Beam checks them as the graph is
    built: file paths where record chunks belong, or rows where selection tables belong, fail
    before anything runs, naming the transform."""
    chunk = record_reading.read_file(write_records(str(tmp_path / "r.jsonl"), [{"id": 1, "users": [1]}]), 0, Columns())
    pipeline = beam.Pipeline(options=pipeline_options([]))
    paths = pipeline | "Paths" >> beam.Create([(0, str(tmp_path / "r.jsonl"))])
    with pytest.raises(TypeCheckError, match=r"(?s)BoundContributions.*RecordChunk"):
        _ = paths | BoundContributions(BoundOptions(max_contributions=2), partitions=2)
    chunks = pipeline | "Chunks" >> beam.Create([(0, chunk.chunk)])
    rows = pipeline | "Rows" >> beam.Create([(0, {"id": 1, "copies": 1})])
    with pytest.raises(TypeCheckError, match=r"(?s)MinSepSample.*Table"):
        _ = (chunks, rows) | MinSepSample(BatchOptions(steps=5, batch_size=2), 2)
    tables = chunks | "Tables" >> beam.Map(lambda _: (0, pa.table({"id": [1], "copies": [1]})))
    _ = (chunks, tables) | "Accepted" >> MinSepSample(BatchOptions(steps=5, batch_size=2), 2)  # right types accepted
    assert sorted(path.name for path in tmp_path.iterdir()) == ["r.jsonl"]  # building the graph wrote nothing


def _rows_and_one_rejected(tmp_path, pipeline):
    """40 records with content, and a PCollection of one row rejected upstream (as reading does)."""
    rows = [{"id": i, "users": [i % 7], "x": float(i)} for i in range(40)]
    chunk = record_reading.read_file(write_records(str(tmp_path / "r.jsonl"), rows), 0, Columns(), ("x",)).chunk
    rejected = Rejects()
    rejected.add("r.jsonl", 40, "empty_users", {"id": 40, "users": []})
    return pipeline | "Records" >> beam.Create([(0, chunk)]), pipeline | "Rejected" >> beam.Create([rejected])


@pytest.mark.parametrize("job", ["bound", "batch"])
def test_under_on_invalid_error_a_row_rejected_before_stops_the_run_before_its_work(tmp_path, job):
    """A row rejected upstream stops the run with the list of rows, kept as data for the driver,
    before the bounding's first round or before any partition is sampled; under skip they run."""
    selection = pa.table({"id": pa.array(range(40), pa.int64()), "copies": pa.array([1] * 40, pa.int64())})
    for on_invalid in ("error", "skip"):
        directory = tmp_path / job / on_invalid
        pipeline = beam.Pipeline(options=pipeline_options(["--direct_running_mode=in_memory"]))
        records, rejected = _rows_and_one_rejected(tmp_path, pipeline)
        if job == "bound":
            options = BoundOptions(max_contributions=1, on_invalid=on_invalid)
            bound = records | BoundContributions(
                options, 2, rejected_before=rejected, output="OUT", errors_dir=str(directory)
            )
            _ = bound.control | beam.Map(lambda _, marks=str(directory): files.write_bytes(f"{marks}/bounded", b""))
            work = str(directory / "bounded")  # written once the bounding is done
        else:
            options = BatchOptions(steps=5, batch_size=3, on_invalid=on_invalid)
            selected = pipeline | "Selection" >> beam.Create([(0, selection)])
            sampled = (records, selected) | MinSepSample(options, 2, rejected, output="OUT", errors_dir=str(directory))
            _ = sampled.rows | beam.Map(
                lambda rows, marks=str(directory): files.write_bytes(f"{marks}/rows-{rows[0]}", b"")
            )
            work = str(directory / "rows-*")  # written once the partitions' samples reach their batch file
        if on_invalid == "error":
            with pytest.raises(InputError, match=r"(?s)1 invalid input rows.*r.jsonl: row 40: empty_users.*OUT/rej"):
                run(pipeline, "madp", str(directory))
            assert not glob.glob(work)
        else:
            run(pipeline, "madp", str(directory))
            assert glob.glob(work)


class _FailingRun:
    """A pipeline whose run fails as a runner reports a worker's failure: in its own words."""

    runner = None  # some runner's: not Beam's DirectRunner, which `run` would replace

    def __init__(self, before_failing=lambda: None):
        self.before_failing = before_failing

    def run(self):
        self.before_failing()
        raise RuntimeError("Pipeline failed: worker 3 exited (see the worker logs)")


def test_an_input_error_a_step_met_is_raised_by_the_driver_whatever_the_runner_says(tmp_path):
    store = str(tmp_path / "store")

    def step_meets_bad_input():
        with pytest.raises(InputError), keeping_input_errors(store):
            raise InputError("data.jsonl row 7: empty_users")

    with pytest.raises(InputError, match=r"^data.jsonl row 7: empty_users$"):
        run(_FailingRun(step_meets_bad_input), "madp.test", store)
    with pytest.raises(RuntimeError, match="worker 3 exited"):  # no input error kept: the runner's own
        run(_FailingRun(), "madp.test", str(tmp_path / "other"))


def test_a_tampered_partial_selection_stops_the_next_run(tmp_path):
    """A pipeline run continues from the selection the last one wrote; other records, or negative
    copies (which would give users capacity back), stop it."""
    import pyarrow.parquet as pq

    from madp.beam.bound_build import _saved_selection, state_path

    keys = np.array([3, 8, 9], np.int64)
    for copies, records, error in (
        ([1, 0, 2], keys, None),
        ([1, -1, 2], keys, "not the selection the last pipeline run wrote"),
        ([1, 0, 2], keys + 1, "the input changed between pipeline runs"),
    ):
        table = pa.table({"key": records, "copies": pa.array(copies, pa.int64()), "in_pass": [True, False, False]})
        pq.write_table(table, state_path(str(tmp_path), 0))
        if error is None:
            saved, in_pass = _saved_selection(str(tmp_path), 0, keys)
            assert saved.tolist() == copies and in_pass.tolist() == [True, False, False]
        else:
            with pytest.raises(RuntimeError, match=error):
                _saved_selection(str(tmp_path), 0, keys)


def ones_own_rows(count: int, seed: int, users: int = 400) -> list[dict]:
    """Rows that are not madp's records (other field names, a numpy content value): an email's sender
    and recipients are its users. Two are rejected (no recipient, a repeated id), one has a repeated user."""
    rng = np.random.default_rng(seed)
    rows = [
        {"message": 10 * i, "from": int(rng.integers(0, users)), "to": rng.integers(0, users, 2), "x": np.float64(i)}
        for i in range(count)
    ]
    rows += [{"message": 5, "from": 1, "to": [], "x": 0.0}, {"message": 10, "from": 3, "to": [4], "x": 1.0}]
    rows[7]["to"] = [rows[7]["from"]]  # a repeated user, removed as in a file
    return rows


EXTRACTORS = RecordExtractors(
    id_extractor=lambda row: row["message"],
    users_extractor=lambda row: [row["from"], *row["to"]] if len(row["to"]) else [],
    content_extractor=lambda row: {"x": row["x"]},
)


def local_results(rows: list[dict], directory, bound_options: BoundOptions, options: BatchOptions):
    """The in-memory engines' sorted (id, copies) selection and (step, id) batch rows on `rows`' records
    in a file."""
    import pyarrow.parquet as pq

    records = [{**EXTRACTORS.record(row), "x": float(row["x"])} for row in rows]
    records = [{**r, "users": [int(u) for u in r["users"]]} for r in records]
    path = write_records(str(directory / "records.jsonl"), records)
    bound_local(path, str(directory / "bounded"), bound_options)
    selected = pa.concat_tables(pq.read_table(p) for p in glob.glob(str(directory / "bounded" / "selected" / "*")))
    batch_local.run_local(str(directory / "bounded"), path, str(directory / "batches"), options)
    batch_rows = sorted((row["step"][0], row["id"][0]) for row in rows_of(str(directory / "batches")))
    return sorted(zip(selected["id"].to_pylist(), selected["copies"].to_pylist())), batch_rows


def test_rows_of_ones_own_are_bounded_and_batched_as_the_same_records_in_a_file(tmp_path):
    """Rows that are not madp's, with the functions that extract their records: BoundContributions and
    MinSepSample take them (and RecordsFromRows reads them once for both), with the same selection,
    rejects and batch rows as the in-memory engines give for those records in a file."""
    rows = ones_own_rows(300, seed=21)
    bound_options = BoundOptions(max_contributions=2, on_invalid="skip")
    options = BatchOptions(seed=4, steps=30, batch_size=12, min_sep=2, output_shards=2, on_invalid="skip")
    expected_selection, expected_rows = local_results(rows, tmp_path, bound_options, options)
    with _test_pipeline() as pipeline:
        shuffled = pipeline | beam.Create([rows[i] for i in np.random.default_rng(3).permutation(len(rows))])
        bound = shuffled | BoundContributions(bound_options, partitions=3, extractors=EXTRACTORS)
        pairs = bound.shards | beam.FlatMapTuple(lambda _, t: zip(t["id"].to_pylist(), t["copies"].to_pylist()))
        assert_that(pairs, equal_to(expected_selection), label="Selection")
        reasons = bound.rejects | "Reasons" >> beam.FlatMap(lambda r: r.reason)
        assert_that(reasons, equal_to(["empty_users", "duplicate_id", "duplicate_id"]), label="Rejects")
        sampled = (shuffled, bound.shards) | MinSepSample(options, 3, extractors=EXTRACTORS)
        batch_rows = sampled.rows | beam.FlatMapTuple(lambda _, r: zip(r.steps.tolist(), r.ids.to_pylist()))
        assert_that(batch_rows, equal_to(expected_rows), label="BatchRows")
        # read by hand: without content for the bounding, with it for the sampling
        records = shuffled | "RecordsOnly" >> RecordsFromRows(EXTRACTORS._replace(content_extractor=None), chunks=2)
        chunks, read_rejects, _ = shuffled | RecordsFromRows(EXTRACTORS, chunks=2)
        selection = (records[0] | "BoundChunks" >> BoundContributions(bound_options, partitions=3)).shards
        shared = (chunks, selection) | "SampleChunks" >> MinSepSample(options, 3)
        shared_rows = shared.rows | "SharedRows" >> beam.FlatMapTuple(
            lambda _, r: zip(r.steps.tolist(), r.ids.to_pylist())
        )
        assert_that(shared_rows, equal_to(expected_rows), label="SharedBatchRows")
        read_reasons = read_rejects | "ReadReasons" >> beam.FlatMap(lambda r: r.reason)
        assert_that(read_reasons, equal_to(["empty_users"]), label="ReadRejects")


@pytest.mark.parametrize(
    "extractors, message",
    [
        (EXTRACTORS._replace(content_extractor=lambda row: {"id": 1}), "a column named 'id'"),
        (
            EXTRACTORS._replace(users_extractor=lambda row: row["cc"]),
            r"users_extractor failed on the row .*KeyError\('cc'\)",
        ),
        (EXTRACTORS._replace(content_extractor=lambda row: {"body": b"bytes"}), "decode bytes to str"),
        (EXTRACTORS._replace(content_extractor=lambda row: "text"), "content_extractor gave a str, not a dict"),
    ],
)
def test_an_extractor_that_fails_or_gives_what_no_record_holds_is_an_error_naming_it(extractors, message):
    with pytest.raises(Exception, match=message):
        with _test_pipeline() as pipeline:
            _ = pipeline | beam.Create(ones_own_rows(10, seed=1)) | RecordsFromRows(extractors)


def test_sampling_ones_own_rows_needs_their_content():
    options = BatchOptions(seed=4, steps=30, batch_size=12, min_sep=2)
    with pytest.raises(InputError, match="content_extractor"):
        MinSepSample(options, 3, extractors=EXTRACTORS._replace(content_extractor=None))


def test_the_bounding_of_ones_own_rows_reads_no_content_and_a_lone_surrogate_is_rejected_as_in_a_file():
    """Content decides nothing in the bounding (as madp bound reads files): rows whose content mixes
    types are bounded. Where content is read, a lone surrogate (rows made in the same fused step meet
    no coder) is an invalid_json reject, as in a file."""
    from madp.beam.record_chunks import _as_line

    rows = [{"message": i, "from": i, "to": [i + 1], "x": "text" if i % 2 else 1.0} for i in range(6)]
    with _test_pipeline() as pipeline:
        bound = (
            pipeline
            | beam.Create(rows)
            | BoundContributions(
                BoundOptions(max_contributions=2, on_invalid="skip"), partitions=2, extractors=EXTRACTORS
            )
        )
        assert_that(bound.shards | beam.MapTuple(lambda _, t: len(t)) | beam.CombineGlobally(sum), equal_to([6]))
    lines = [
        _as_line({**row, "x": "\ud800" if i == 3 else "text"}, EXTRACTORS, 1, None)[1] for i, row in enumerate(rows)
    ]
    read = record_reading.read_lines(lines, "rows", 0, Columns(), record_reading.OTHER_COLUMNS)
    assert read.rejects.counts() == {"invalid_json": 1} and len(read.chunk) == 5
