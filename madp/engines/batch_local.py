"""`madp batch --runner local`: the samplers on the whole selection as one partition, in memory."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import pyarrow as pa

from madp.core import record_reading, sampling
from madp.core import records as rec
from madp.core.batch_files import USER_FEATURE, batch_file_path, step_range, write_batch_file, write_schema
from madp.core.batch_steps import (
    JoinedPartition,
    Samples,
    rows_of_file,
    sample_incidences,
    sampled_units,
    written_samples,
)
from madp.core.errors import InputError, check_memory
from madp.core.graph_digest import graph_digest
from madp.core.hashing import siphash24
from madp.core.progress import Progress
from madp.core.reports import BatchReport
from madp.core.selection import handle_rejects, read_selection_file, selection_files, write_report
from madp.engines.batch_report import Sampled, participation_stats, prepare_output, refuse_losing_trainings, report
from madp.engines.batching import (
    USER_SAMPLING_STREAM,
    BatchOptions,
    bound_graph,
    check_content,
    check_same_graph,
    join_selection,
    record_hashes,
    schema,
    skip_invalid_content,
    user_hashes,
)

log = logging.getLogger("madp.batch")


@dataclasses.dataclass
class Dataset:
    """Selected records (one row each), their copies, users as CSR of hashes, content, and whether
    their rows are written (`valid`: False for invalid content under --on-invalid skip; such records
    are sampled like any other)."""

    ids: pa.Array
    copies: np.ndarray
    offsets: np.ndarray
    users: np.ndarray
    content: pa.Table
    rejects: rec.Rejects
    valid: np.ndarray


def load(selected: str, data: str, options: BatchOptions, output: str) -> Dataset:
    from madp.engines.local_engine import read_input

    names = record_reading.OTHER_COLUMNS if options.content_columns is None else options.content_columns
    selection_paths = selection_files(selected)
    bound = bound_graph(selected)
    chunk, rejects, _, _ = read_input(data, bound.columns(options.columns), names, "madp batch --runner local")
    if options.on_invalid == "error":
        handle_rejects(rejects, options.on_invalid, output)
    found = graph_digest(chunk.ids, chunk.offsets, chunk.users)  # of DATA's valid records, selected or not
    selection = [read_selection_file(path) for path in selection_paths]
    ids = pa.concat_arrays([s[0] for s in selection])
    copies = np.concatenate([s[1] for s in selection])
    chunk, copies = join_selection(chunk, ids, copies, data)  # selected ids missing from DATA: named first
    check_same_graph(found, bound, data)  # before any content check: DATA must be the graph bounded
    valid = np.ones(len(copies), dtype=bool)  # under --on-invalid error, check_content refuses invalid content
    if options.on_invalid == "skip":
        valid = skip_invalid_content(chunk, rejects)
    if not len(copies):
        raise InputError(f"{selected} selects no record (its bound kept none): there is nothing to batch")
    return Dataset(
        ids=chunk.ids,
        copies=copies,
        offsets=chunk.offsets,
        users=user_hashes(chunk.users, options.key),
        content=chunk.content,
        rejects=rejects,
        valid=valid,
    )


def minsep_rows(dataset: Dataset, options: BatchOptions) -> Sampled:
    """Alg. 3 on the whole dataset, p calibrated to the target expected batch size."""
    n = len(dataset.copies)
    arity = np.diff(dataset.offsets)
    record_of_incidence = np.repeat(np.arange(n, dtype=np.int64), arity)
    neighbourhoods = sampling.neighbourhood_sizes(record_of_incidence, dataset.users, dataset.copies)
    record_of_unit, keys = sampling.unit_keys(record_hashes(dataset.ids, options.key), dataset.copies)
    histogram = sampling.size_histogram(neighbourhoods[record_of_unit])
    probability = sampling.calibrate_probability(options.batch_size, *histogram, options.min_sep)
    total = options.sampled_steps
    _check_fits(probability * len(keys) * total, options)
    samples = sampled_units(record_of_unit, keys, probability, total)
    users, steps, owner = sample_incidences(dataset.offsets, dataset.users, samples)
    blocked = sampling.blocked_user_steps(users, steps, options.min_sep)
    survive = ~sampling.excluded_samples(owner, blocked, len(samples.step))
    return Sampled(
        samples.record[survive],
        samples.keys[survive],
        samples.step[survive],
        options.min_sep,
        probability,
        sampling.expected_batch_size(probability, *histogram, options.min_sep),
    )


# Bytes per sampled row in the local engine at its peak (unit, step, record, keys, incidences, sort copies).
BYTES_PER_SAMPLE = 200


def _check_fits(expected_rows: float, options: BatchOptions) -> None:
    """Refuse, before allocating, a sampling whose rows cannot fit in this machine's memory."""
    check_memory(
        expected_rows * BYTES_PER_SAMPLE,
        f"--steps {options.steps} with --batch-size {options.batch_size:g} samples about {expected_rows:.3g} rows,",
        "use fewer steps or a smaller batch size, or --runner with a Beam cluster",
    )


def greedy_rows(dataset: Dataset, options: BatchOptions) -> Sampled:
    """Alg. 4; with --find-max-min-sep, the largest b before the first failure, trying b = 1, 2, ..."""
    n, batch = len(dataset.copies), int(options.batch_size)
    _check_fits(float(options.steps) * batch, options)
    if batch > n:
        raise InputError(
            f"--batch-size {batch} is larger than the {n} selected records: a batch cannot hold a record twice"
        )
    arity = np.diff(dataset.offsets)
    record_of_incidence = np.repeat(np.arange(n, dtype=np.int64), arity)
    _, user_codes = np.unique(dataset.users, return_inverse=True)
    tried: list[dict] = []

    def attempt(min_sep: int):
        chosen, filled = sampling.greedy_minsep(
            record_of_incidence, user_codes.astype(np.int64), n, options.steps, batch, min_sep
        )
        tried.append({"min_sep": min_sep, "feasible": chosen is not None})
        if chosen is None and (not options.find_max_min_sep or min_sep == 1):
            raise InputError(
                f"no solution for --steps {options.steps} --batch-size {batch} --min-sep {min_sep}: "
                f"batch {filled} cannot be filled, a full pass over the {n} selected records adds "
                f"none to it; lower --min-sep or --batch-size"
                + ("" if options.find_max_min_sep else ", or try --find-max-min-sep")
            )
        return chosen

    if not options.find_max_min_sep:
        chosen, min_sep = attempt(options.min_sep), options.min_sep
    else:
        chosen, min_sep = attempt(1), 1
        while min_sep < options.steps:
            candidate = attempt(min_sep + 1)
            if candidate is None:
                break
            chosen, min_sep = candidate, min_sep + 1
    steps = np.repeat(np.arange(options.steps, dtype=np.int64), batch)
    # A record's copies are interchangeable here; the greedy may use a record any number of times.
    keys = sampling.splitmix64(record_hashes(dataset.ids, options.key)[chosen] ^ steps.astype(np.uint64))
    return Sampled(chosen, keys, steps, min_sep, min_sep_search=tried)


def user_rows(dataset: Dataset, options: BatchOptions) -> Sampled:
    """User-level Poisson sampling (ELS paper's ULS) for single-attribution records: each step
    samples every user with probability q = B / users (geometric gaps keyed by (seed, user)),
    and a sampled user brings all its units."""
    distinct, user_of_record = np.unique(_single_users(dataset), return_inverse=True)
    if not 0 < options.batch_size <= len(distinct):
        raise InputError(f"--batch-size (users per step) must be in (0, {len(distinct)}] for --sampler users")
    probability = options.batch_size / len(distinct)
    _check_fits(probability * float(dataset.copies.sum()) * options.steps, options)
    # Keyed over the whole user id: `distinct` are `user_hashes`, keyed for string users, injective for integers.
    user_keys = siphash24(options.key.subkey(USER_SAMPLING_STREAM), distinct)
    user, step = sampling.sampled_steps(user_keys, probability, options.steps)
    record_of_unit, keys = sampling.unit_keys(record_hashes(dataset.ids, options.key), dataset.copies)
    by_user = np.argsort(user_of_record[record_of_unit], kind="stable")
    units_per_user = np.bincount(user_of_record[record_of_unit], minlength=len(distinct))
    first_unit = np.concatenate([[0], np.cumsum(units_per_user)[:-1]])
    owner, position = sampling.expand_ranges(first_unit[user], units_per_user[user])
    unit = by_user[position]
    return Sampled(
        record_of_unit[unit],
        keys[unit],
        step[owner],
        1,
        probability,
        float(options.batch_size),
        sampled_users=np.bincount(step, minlength=options.steps),
    )


def _single_users(dataset: Dataset) -> np.ndarray:
    """The user of each record, which must have exactly one (user-level sampling)."""
    arity = np.diff(dataset.offsets)
    if (arity != 1).any():
        first = int(np.flatnonzero(arity != 1)[0])
        raise InputError(
            f"--sampler users needs single-attribution records (one user each); record "
            f"{dataset.ids[first].as_py()!r} has {int(arity[first])}"
        )
    return dataset.users


def run_local(selected: str, data: str, output: str, options: BatchOptions, engine: str = "local") -> BatchReport:
    """`madp batch --runner local`: load, sample, write TFRecords, schema and report."""
    started = time.perf_counter()
    refuse_losing_trainings(output)  # before the work, and again as the earlier batches go (prepare_output)
    dataset = load(selected, data, options, output)
    if options.sampler == "users":
        if USER_FEATURE in dataset.content.column_names:
            raise InputError(
                f"--sampler users adds a feature {USER_FEATURE!r}: leave the content column "
                f"{USER_FEATURE!r} out with --content-columns"
            )
        dataset.content = dataset.content.append_column(USER_FEATURE, pa.array(_single_users(dataset).view(np.int64)))
    described = check_content(dataset.content, dataset.ids, dataset.valid)
    samplers = {"minsep": minsep_rows, "minsep-greedy": greedy_rows, "users": user_rows}
    sampled = samplers[options.sampler](dataset, options)
    # How many rows were sampled depends on the secret sampling, and so does how long sampling took; logs get
    # shared: both at debug level only.
    log.debug(
        "sampled %d rows in %.1f s (internal: realized sampling)", len(sampled.record), time.perf_counter() - started
    )
    warm_up = options.warm_up_steps
    sampled_sizes = np.bincount(sampled.step, minlength=options.steps + warm_up)
    # After warm-up, the rows of records with valid content (the others were sampled and excluded like any).
    files = options.output_shards
    written = written_samples(
        dataset.valid, Samples(sampled.record, sampled.keys, sampled.step), warm_up, options.steps, files
    )

    prepare_output(output)
    handle_rejects(dataset.rejects, options.on_invalid, output)
    joined = JoinedPartition(
        dataset.ids,
        dataset.copies,
        dataset.offsets,
        dataset.users,
        dataset.content,
        record_hashes(dataset.ids, options.key),
        dataset.valid,
    )
    results = []
    progress = Progress(log, "writing batch files", files, "files")
    for file in range(files):
        rows = rows_of_file(joined, written, file)
        results.append(
            write_batch_file(
                batch_file_path(output, file, files),
                rows,
                step_range(file, options.steps, files),
                options.max_batch_size,
                described,
            )
        )
        progress.update(file + 1, f", {batch_file_path(output, file, files)}")
    write_schema(output, schema(dataset.ids.type, described, options))
    written_records = np.unique(np.concatenate([r.record_keys for r in results]))
    result = report(
        options,
        engine,
        selected,
        data,
        output,
        sampled=sampled,
        units=int(dataset.copies.sum()),
        records=len(dataset.copies),
        sampled_sizes=sampled_sizes,
        files=[r.counts for r in results],
        records_never_written=len(dataset.copies) - len(written_records),
        participation=participation_stats(
            np.concatenate([r.user_hashes for r in results]), np.concatenate([r.user_steps for r in results])
        ),
        rejects=dataset.rejects,
        content_columns=dataset.content.column_names,
        started=started,
    )
    write_report(output, result)
    return result
