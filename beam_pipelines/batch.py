"""Batch materialization (b-min-sep Poisson sampling, Alg. 3) as Apache Beam pipelines: the
`madp.sampling` kernels on record, user and file partitions, in their parallel form (no loop over
steps). Two pipeline runs, because p must be calibrated before sampling:

  Prepare: files -> record partitions (join with the selection) -> user partitions
           -> neighbour pairs -> record partitions -> histogram of |N(e)|        (driver: p)
  Sample:  record partitions (sample steps) -> user partitions (blocked (user, step))
           -> record partitions (survivors) -> files (order, truncate, pad, write)
           -> user / record partitions (participation statistics)

Elements are whole columnar partitions; arrays go through a `PartitionStore` under OUTPUT/_work/
and only handles travel through the graph. The greedy sampler (Alg. 4) is sequential by
definition and runs in the driver whatever the runner.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.metrics import Metrics

from beam_pipelines.pipeline import by_kind, merge_rejects, pipeline_options, run
from beam_pipelines.store import PartitionStore
from madp import batch_files, batch_local, batch_report, batching, sampling, storage
from madp import records as rec
from madp.hashing import partition_of
from madp.randomness import SecretKey
from madp.selection import handle_rejects, selection_files, write_report

log = logging.getLogger("madp.batch")
WORK_DIR = "_work"
DEFAULT_PARTITIONS = 4
NAMESPACE = "madp.batch"


def _count(name: str, value: int) -> None:
    """A Beam counter (retried bundles may inflate it; the report's figures come from the outputs)."""
    Metrics.counter(NAMESPACE, name).inc(int(value))


def _part_of_hash(hashes: np.ndarray, partitions: int) -> np.ndarray:
    return (hashes % np.uint64(partitions)).astype(np.int64)


def _slices(store: PartitionStore, name: str, destination: np.ndarray, payload) -> list[tuple[int, tuple]]:
    """Split aligned arrays by destination partition into one store file; (destination, handle) pairs."""
    parts = {int(d): payload(destination == d) for d in np.unique(destination)}
    return list(store.write_slices(name, parts).items()) if parts else []


def _gather(store: PartitionStore, handles) -> list:
    return [store.read_slice(h) for h in sorted(handles)]


def _stack(pieces: list[tuple], field: int) -> np.ndarray:
    """One array from field `field` of every gathered message."""
    return np.concatenate([piece[field] for piece in pieces])


# --- prepare ------------------------------------------------------------------------------------


class _ReadDataFile(beam.DoFn):
    def __init__(self, columns: rec.Columns, content: tuple[str, ...], partitions: int, store: PartitionStore):
        self.columns, self.content, self.partitions, self.store = columns, content, partitions, store

    def process(self, element):
        index, path = element
        result = rec.read_file(path, index, self.columns, self.content)
        if len(result.rejects):
            yield beam.pvalue.TaggedOutput("rejects", result.rejects)
        chunk = result.chunk
        destination = partition_of(chunk.ids, self.partitions) if len(chunk) else np.zeros(0, np.int64)
        for part, handle in _slices(
            self.store, f"data-{index:06d}.pkl", destination, lambda mask: rec.take(chunk, mask)
        ):
            yield part, ("records", handle)


class _ReadSelectionFile(beam.DoFn):
    def __init__(self, partitions: int, store: PartitionStore):
        self.partitions, self.store = partitions, store

    def process(self, element):
        index, path = element
        ids, copies = batching.read_selection_file(path)
        destination = partition_of(ids, self.partitions) if len(ids) else np.zeros(0, np.int64)
        for part, handle in _slices(
            self.store,
            f"selection-{index:06d}.pkl",
            destination,
            lambda mask: (ids.filter(pa.array(mask)), copies[mask]),
        ):
            yield part, ("selection", handle)


class _BuildRecordPartition(beam.DoFn):
    """Join a record partition with its selected ids; store it; send incidences to user partitions."""

    def __init__(self, data: str, key: SecretKey, on_invalid: str, partitions: int, store: PartitionStore):
        self.data, self.key, self.on_invalid, self.partitions, self.store = data, key, on_invalid, partitions, store

    def process(self, element):
        part, values = element
        handles = by_kind(values)
        chunks = sorted(_gather(self.store, handles.get("records", [])), key=lambda c: int(c.keys[0]))
        rejects = rec.Rejects()
        chunk = rec.reject_duplicates(rec.merge_chunks(chunks), rejects) if chunks else None
        if len(rejects):
            yield beam.pvalue.TaggedOutput("rejects", rejects)
        selection = _gather(self.store, handles.get("selection", []))
        if not selection:
            return
        ids = pa.concat_arrays([s[0] for s in selection])
        copies = np.concatenate([s[1] for s in selection])
        if chunk is None:
            raise rec.InputError(
                f"{len(ids)} selected ids are not valid records of {self.data} "
                f"(e.g. {ids[0].as_py()!r}): was SELECTED bounded from this data?"
            )
        chunk, copies = batching.join_selection(chunk, ids, copies, self.data)
        if self.on_invalid == "skip":
            content_rejects = rec.Rejects()
            chunk, copies = batching.skip_invalid_content(chunk, copies, content_rejects)
            if len(content_rejects):
                yield beam.pvalue.TaggedOutput("rejects", content_rejects)
        yield _summary_value("described", batching.check_content(chunk.content, chunk.ids))
        yield _summary_value("records", len(copies))
        yield _summary_value("id_type", chunk.ids.type)
        users = batching.user_hashes(chunk.users)
        record_keys = batching.record_hashes(chunk.ids, self.key)
        partition = {
            "ids": chunk.ids,
            "copies": copies,
            "offsets": chunk.offsets,
            "users": users,
            "content": chunk.content,
            "record_keys": record_keys,
        }
        yield _summary_value("partition", (part, self.store.write_arrays(f"records-{part:05d}.pkl", partition)))
        record_of_incidence = np.repeat(np.arange(len(copies)), np.diff(chunk.offsets))
        destination = _part_of_hash(users, self.partitions)
        yield from _slices(
            self.store,
            f"incidences-{part:05d}.pkl",
            destination,
            lambda mask: (users[mask], record_keys[record_of_incidence[mask]], copies[record_of_incidence[mask]]),
        )


class _NeighbourPairs(beam.DoFn):
    """Within a user partition: the (record, neighbour) pairs its users make, sent to the record's partition."""

    def __init__(self, partitions: int, store: PartitionStore):
        self.partitions, self.store = partitions, store

    def process(self, element):
        part, handles = element
        pieces = _gather(self.store, handles)
        users = _stack(pieces, 0)
        record_keys = _stack(pieces, 1)
        copies = _stack(pieces, 2)
        keys, first, local = np.unique(record_keys, return_index=True, return_inverse=True)
        for chunk_index, (owner, neighbour) in enumerate(sampling.neighbour_pairs(local.ravel(), users)):
            owner_keys, neighbour_keys, neighbour_copies = keys[owner], keys[neighbour], copies[first[neighbour]]
            destination = _record_partition_of(owner_keys, self.partitions)
            yield from _slices(
                self.store,
                f"pairs-{part:05d}-{chunk_index:05d}.pkl",
                destination,
                lambda mask: (owner_keys[mask], neighbour_keys[mask], neighbour_copies[mask]),  # noqa: B023 (used now)
            )


def _summary_value(name: str, value) -> beam.pvalue.TaggedOutput:
    """A named value of any kind (a histogram, a file's counts, a partition's handle) for the driver's summary
    of the run; unlike `bound_rounds.stat`, no Beam counter."""
    return beam.pvalue.TaggedOutput("stats", (name, value))


def _record_partition_of(record_keys: np.ndarray, partitions: int) -> np.ndarray:
    return partition_of(record_keys.view(np.int64), partitions)


def _neighbourhood_histogram(element, store: PartitionStore):
    """Deduplicate a record partition's pairs (two shared users make one neighbour), then count
    units by |N|: a record has as many units as the copies on its pair with itself."""
    _, handles = element
    pieces = _gather(store, handles)
    owner, neighbour, copies = (_stack(pieces, i) for i in range(3))
    order = np.lexsort((neighbour, owner))
    owner, neighbour, copies = owner[order], neighbour[order], copies[order]
    new = np.concatenate([[True], (owner[1:] != owner[:-1]) | (neighbour[1:] != neighbour[:-1])])
    owner, neighbour, copies = owner[new], neighbour[new], copies[new]
    group = np.cumsum(np.concatenate([[True], owner[1:] != owner[:-1]])) - 1
    sizes = np.bincount(group, weights=copies).astype(np.int64)
    units = np.zeros(len(sizes), np.int64)
    itself = neighbour == owner
    units[group[itself]] = copies[itself]
    values, counts = sampling.size_histogram(np.repeat(sizes, units))
    yield dict(zip(values.tolist(), counts.tolist()))


def _merge_histograms(histograms) -> dict:
    merged: dict = {}
    for histogram in histograms:
        for size, count in histogram.items():
            merged[size] = merged.get(size, 0) + count
    return merged


class PreparePipeline(beam.PTransform):
    """Read, validate and join; store record partitions; histogram of |N(e)| over units."""

    def __init__(
        self,
        data_files: list[str],
        selection_files: list[str],
        data: str,
        content: tuple[str, ...],
        options: batching.BatchOptions,
        partitions: int,
        store: PartitionStore,
    ):
        super().__init__()
        self.data_files, self.selection_files, self.data, self.content = data_files, selection_files, data, content
        self.options, self.partitions, self.store = options, partitions, store

    def expand(self, pbegin):
        store, partitions = self.store, self.partitions
        read = (
            pbegin
            | "ListDataFiles" >> beam.Create(list(enumerate(self.data_files)))
            | "SpreadDataFiles" >> beam.Reshuffle()
            | "ReadAndValidate"
            >> beam.ParDo(_ReadDataFile(self.options.columns, self.content, partitions, store)).with_outputs(
                "rejects", main="records"
            )
        )
        selection = (
            pbegin
            | "ListSelectionFiles" >> beam.Create(list(enumerate(self.selection_files)))
            | "ReadSelection" >> beam.ParDo(_ReadSelectionFile(partitions, store))
        )
        built = (
            (read.records, selection)
            | "RecordsAndSelection" >> beam.Flatten()
            | "GroupRecordPartitions" >> beam.GroupByKey()
            | "JoinSelection"
            >> beam.ParDo(
                _BuildRecordPartition(self.data, self.options.key, self.options.on_invalid, partitions, store)
            ).with_outputs("stats", "rejects", main="incidences")
        )
        histogram = (
            built.incidences
            | "GroupUserPartitions" >> beam.GroupByKey()
            | "NeighbourPairs" >> beam.ParDo(_NeighbourPairs(partitions, store))
            | "GroupPairsByRecord" >> beam.GroupByKey()
            | "NeighbourhoodHistogram" >> beam.FlatMap(_neighbourhood_histogram, store)
            | "MergeHistograms" >> beam.CombineGlobally(_merge_histograms)
            | "NamedHistogram" >> beam.Map(lambda h: ("histogram", h))
        )
        rejects = (
            (read.rejects, built.rejects)
            | "AllRejects" >> beam.Flatten()
            | "MergeRejects" >> beam.CombineGlobally(merge_rejects)
            | "NamedRejects" >> beam.Map(lambda r: ("rejects", r))
        )
        return (
            (histogram, rejects, built.stats)
            | "PrepareSummary" >> beam.Flatten()
            | "CollectPrepare" >> beam.combiners.ToList()
            | "WritePrepare" >> beam.Map(lambda items: store.write_arrays("prepare-summary.pkl", items))
        )


# --- sample -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    probability: float
    total_steps: int
    warm_up: int
    steps: int
    min_sep: int
    files: int
    max_batch_size: int | None
    output: str
    shapes: dict


class _SamplePartition(beam.DoFn):
    """Alg. 3 line 3 for a record partition; each sample's users go to their user partitions."""

    def __init__(self, plan: _Plan, partitions: int, store: PartitionStore):
        self.plan, self.partitions, self.store = plan, partitions, store

    def process(self, element):
        part, path = element
        partition = self.store.read_arrays(path)
        record_of_unit, keys = sampling.unit_keys(partition["record_keys"], partition["copies"])
        unit, step = sampling.sampled_steps(keys, self.plan.probability, self.plan.total_steps)
        record = record_of_unit[unit]
        _count("units", len(keys))
        _count("sampled_unit_steps", len(unit))
        yield (
            part,
            (
                "samples",
                self.store.write_arrays(
                    f"samples-{part:05d}.pkl", {"record": record, "keys": keys[unit], "step": step}
                ),
            ),
        )
        owner, flat = batch_files.incidences_of(partition["offsets"], record)
        users = partition["users"][flat]
        for user_part, handle in _slices(
            self.store,
            f"sampled-users-{part:05d}.pkl",
            _part_of_hash(users, self.partitions),
            lambda mask: (users[mask], step[owner[mask]], owner[mask], part),
        ):
            yield beam.pvalue.TaggedOutput("incidences", (user_part, handle))


class _BlockUsers(beam.DoFn):
    """Alg. 3 line 4 within a user partition; excluded samples go back to their record partitions."""

    def __init__(self, plan: _Plan, store: PartitionStore):
        self.plan, self.store = plan, store

    def process(self, element):
        user_part, handles = element
        pieces = _gather(self.store, handles)
        users = _stack(pieces, 0)
        steps = _stack(pieces, 1)
        samples = _stack(pieces, 2)
        source = np.concatenate([np.full(len(p[0]), p[3], np.int64) for p in pieces])
        blocked = sampling.blocked_user_steps(users, steps, self.plan.min_sep)
        excluded_samples, excluded_source = samples[blocked], source[blocked]
        for part, handle in _slices(
            self.store, f"excluded-{user_part:05d}.pkl", excluded_source, lambda mask: excluded_samples[mask]
        ):
            yield part, ("excluded", handle)


class _Survivors(beam.DoFn):
    """Alg. 3 line 5 for a record partition; survivors after warm-up go to their batch files."""

    def __init__(self, plan: _Plan, partition_paths: dict[int, str], store: PartitionStore):
        self.plan, self.partition_paths, self.store = plan, partition_paths, store

    def process(self, element):
        part, values = element
        handles = by_kind(values)
        if "samples" not in handles:
            return
        samples = self.store.read_arrays(handles["samples"][0])
        survive = np.ones(len(samples["step"]), dtype=bool)
        for excluded in _gather(self.store, handles.get("excluded", [])):
            survive[excluded] = False
        _count("excluded_by_min_sep", int((~survive).sum()))
        record, keys, step = samples["record"][survive], samples["keys"][survive], samples["step"][survive]
        yield _summary_value("sampled_sizes", np.bincount(step, minlength=self.plan.total_steps))
        real = step >= self.plan.warm_up
        record, keys, step = record[real], keys[real], step[real] - self.plan.warm_up
        partition = self.store.read_arrays(self.partition_paths[part])
        file_of_row = batch_files.file_of_step(step, self.plan.steps, self.plan.files)
        rows_by_file = {}
        for file in range(self.plan.files):  # every file hears from every partition, so empty files are written
            mine = np.flatnonzero(file_of_row == file)
            rows_by_file[file] = batch_files.file_rows(
                partition["ids"],
                partition["content"],
                partition["offsets"],
                partition["users"],
                partition["record_keys"],
                record[mine],
                keys[mine],
                step[mine],
            )
        yield from self.store.write_slices(f"rows-{part:05d}.pkl", rows_by_file).items()


def _concat_rows(pieces: list[batch_files.FileRows]) -> batch_files.FileRows:
    base = np.cumsum([0] + [int(p.user_offsets[-1]) for p in pieces[:-1]])
    return batch_files.FileRows(
        steps=np.concatenate([p.steps for p in pieces]),
        unit_keys=np.concatenate([p.unit_keys for p in pieces]),
        record_keys=np.concatenate([p.record_keys for p in pieces]),
        ids=pa.concat_arrays([p.ids for p in pieces]),
        content=pa.concat_tables([p.content for p in pieces]),
        user_offsets=np.concatenate([[0]] + [p.user_offsets[1:] + b for p, b in zip(pieces, base)]).astype(np.int64),
        users=np.concatenate([p.users for p in pieces]),
    )


class _WriteFile(beam.DoFn):
    """Order, truncate, pad and write one batch file; written rows go on to the statistics."""

    def __init__(self, plan: _Plan, partitions: int, store: PartitionStore):
        self.plan, self.partitions, self.store = plan, partitions, store

    def process(self, element):
        file, handles = element
        rows = _concat_rows(_gather(self.store, handles))
        result = batch_files.write_batch_file(
            batch_files.batch_file_path(self.plan.output, file, self.plan.files),
            rows,
            batch_files.step_range(file, self.plan.steps, self.plan.files),
            self.plan.max_batch_size,
            self.plan.shapes,
        )
        _count("written_rows", int(result["written"].sum()))
        _count("truncated_rows", result["truncated"])
        _count("padding_rows", result["padding"])
        yield _summary_value("file", (file, {k: result[k] for k in ("written", "truncated", "padding")}))
        users, steps, records = result["user_hashes"], result["user_steps"], result["record_keys"]
        for user_part, handle in _slices(
            self.store,
            f"written-users-{file:05d}.pkl",
            _part_of_hash(users, self.partitions),
            lambda mask: (users[mask], steps[mask]),
        ):
            yield beam.pvalue.TaggedOutput("users", (user_part, handle))
        for record_part, handle in _slices(
            self.store,
            f"written-records-{file:05d}.pkl",
            _record_partition_of(records, self.partitions),
            lambda mask: records[mask],
        ):
            yield beam.pvalue.TaggedOutput("records", (record_part, handle))


def _participation(element, store: PartitionStore):
    _, handles = element
    pieces = _gather(store, handles)
    yield "participation", batch_report.participation_stats(_stack(pieces, 0), _stack(pieces, 1))


def _written_records(element, store: PartitionStore):
    _, handles = element
    yield "written_records", len(np.unique(np.concatenate(_gather(store, handles))))


class SamplePipeline(beam.PTransform):
    """Sample, exclude, write the batch files, and gather the report's statistics."""

    def __init__(self, plan: _Plan, partition_paths: dict[int, str], partitions: int, store: PartitionStore):
        super().__init__()
        self.plan, self.partition_paths, self.partitions, self.store = plan, partition_paths, partitions, store

    def expand(self, pbegin):
        plan, store, partitions = self.plan, self.store, self.partitions
        sampled = (
            pbegin
            | "ListPartitions" >> beam.Create(sorted(self.partition_paths.items()))
            | "SpreadPartitions" >> beam.Reshuffle()
            | "SampleSteps"
            >> beam.ParDo(_SamplePartition(plan, partitions, store)).with_outputs("incidences", main="samples")
        )
        excluded = (
            sampled.incidences
            | "GroupSampledUsers" >> beam.GroupByKey()
            | "BlockUsers" >> beam.ParDo(_BlockUsers(plan, store))
        )
        survivors = (
            (sampled.samples, excluded)
            | "SamplesAndExclusions" >> beam.Flatten()
            | "GroupSamplesByRecord" >> beam.GroupByKey()
            | "DropExcluded"
            >> beam.ParDo(_Survivors(plan, self.partition_paths, store)).with_outputs("stats", main="rows")
        )
        written = (
            survivors.rows
            | "GroupRowsByFile" >> beam.GroupByKey()
            | "WriteBatchFiles"
            >> beam.ParDo(_WriteFile(plan, partitions, store)).with_outputs("users", "records", "stats", main="unused")
        )
        participation = (
            written.users
            | "GroupWrittenUsers" >> beam.GroupByKey()
            | "Participation" >> beam.FlatMap(_participation, store)
        )
        records = (
            written.records
            | "GroupWrittenRecords" >> beam.GroupByKey()
            | "WrittenRecords" >> beam.FlatMap(_written_records, store)
        )
        return (
            (survivors.stats, written.stats, participation, records)
            | "SampleSummary" >> beam.Flatten()
            | "CollectSample" >> beam.combiners.ToList()
            | "WriteSample" >> beam.Map(lambda items: store.write_arrays("sample-summary.pkl", items))
        )


# --- driver -------------------------------------------------------------------------------------


def _merge_described(described: list[dict]) -> dict:
    merged: dict = {}
    for one in described:
        for name, feature in one.items():
            seen = merged.setdefault(name, dict(feature))
            if seen["dtype"] != feature["dtype"]:
                raise rec.InputError(
                    f"content column {name!r} is {seen['dtype']} in some records and {feature['dtype']} in others"
                )
            if seen["shape"] != feature["shape"]:
                seen["shape"] = [None]
    return merged


def run_beam(
    selected: str,
    data: str,
    output: str,
    options: batching.BatchOptions,
    beam_args: list[str],
    partitions: int = DEFAULT_PARTITIONS,
) -> dict:
    """`madp batch --runner <Beam runner>`: a prepare run, calibration of p in the driver, a sample run."""
    if partitions < 1:
        raise rec.InputError("--partitions must be at least 1")
    if options.sampler != "minsep":
        log.warning("--sampler %s runs in this process, not on the Beam runner", options.sampler)
        return batch_local.run_local(
            selected, data, output, options, engine=f"local ({options.sampler} runs in the driver)"
        )
    started = time.perf_counter()
    data_files = rec.list_input_files(data)
    content = (
        options.content_columns
        if options.content_columns is not None
        else rec.content_columns(data_files[0], options.columns)
    )
    selection = selection_files(selected)
    work = storage.join(output, WORK_DIR)
    storage.clear_directory(work)
    batch_report.prepare_output(output)
    store = PartitionStore(storage.join(work, uuid.uuid4().hex[:12]))
    beam_options = pipeline_options(beam_args)

    counters = []
    pipeline = beam.Pipeline(options=beam_options)
    _ = pipeline | "Prepare" >> PreparePipeline(data_files, selection, data, content, options, partitions, store)
    try:
        counters.append(run(pipeline, NAMESPACE))
        prepared = by_kind(store.read_arrays(storage.join(store.directory, "prepare-summary.pkl")))
        rejects = prepared.get("rejects", [rec.Rejects()])[0]
        handle_rejects(rejects, options.on_invalid, output)
        described = _merge_described(prepared.get("described", []))
        histogram = prepared.get("histogram", [{}])[0]
        sizes = np.array(sorted(histogram), dtype=np.int64)
        counts = np.array([histogram[s] for s in sizes.tolist()], dtype=np.int64)
        probability = sampling.calibrate_probability(options.batch_size, sizes, counts, options.min_sep)
        log.info("calibrated p = %.6g for an expected batch size of %g", probability, options.batch_size)
        plan = _Plan(
            probability=probability,
            total_steps=options.steps + options.warm_up_steps,
            warm_up=options.warm_up_steps,
            steps=options.steps,
            min_sep=options.min_sep,
            files=options.output_shards,
            max_batch_size=options.max_batch_size,
            output=output,
            shapes=batch_files.content_shapes(described),
        )
        partition_paths = dict(prepared.get("partition", []))
        pipeline = beam.Pipeline(options=beam_options)
        _ = pipeline | "Sample" >> SamplePipeline(plan, partition_paths, partitions, store)
        counters.append(run(pipeline, NAMESPACE))
        summary = by_kind(store.read_arrays(storage.join(store.directory, "sample-summary.pkl")))
    except rec.InputError:
        batch_report.prepare_output(output)  # no partial batches outlive an error
        storage.clear_directory(work)
        raise
    id_type = prepared.get("id_type", [pa.int64()])[0]
    batch_files.write_schema(output, batching.schema(id_type, described, options))
    records = sum(prepared.get("records", []))
    files = [f for _, f in sorted(summary.get("file", []), key=lambda item: item[0])]
    sampled = batch_report.Sampled(
        np.zeros(0, np.int64),
        np.zeros(0, np.uint64),
        np.zeros(0, np.int64),
        options.min_sep,
        probability,
        sampling.expected_batch_size(probability, sizes, counts, options.min_sep),
    )
    result = batch_report.report(
        options,
        beam_options.view_as(beam.options.pipeline_options.StandardOptions).runner,
        selected,
        data,
        output,
        sampled=sampled,
        units=int(counts.sum()),
        records=records,
        sampled_sizes=np.sum(summary.get("sampled_sizes", [np.zeros(plan.total_steps, np.int64)]), axis=0),
        files=files,
        records_never_written=records - sum(summary.get("written_records", [])),
        participation=batch_report.merge_participation_stats(summary.get("participation", [])),
        rejects=rejects,
        content_columns=list(content),
        started=started,
    )
    result.update(partitions=partitions, beam_counters_per_run=counters)
    storage.clear_directory(work)
    write_report(output, result)
    return result
