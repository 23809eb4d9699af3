"""The k sweep: the contribution bound to choose, by records kept against noise, and its `madp run` job."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from madp.core.errors import InputError
from madp.stages.arguments import options_of
from madp.tools.planning.recommend import Recommendation, Sweep, job_config, recommend, train_section, write_sweep
from madp.tools.planning.recommend import write_config as write_job_config

log = logging.getLogger("madp")


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """The `madp run` config to write for the recommended k (`--write-config`) and what its train section
    trains: its run_dir (None: beside the config), model, public labels, label and text columns."""

    path: str
    run_dir: str | None = None
    model: str | None = None
    labels: tuple[str, ...] | None = None
    label_column: str = "label"
    text_column: str | None = None


def job_config_of(
    path: str | None,
    run_dir: str | None = None,
    model: str | None = None,
    labels: tuple[str, ...] | None = None,
    label_column: str = "label",
    text_column: str | None = None,
) -> JobConfig | None:
    """The config to write at `path`, or None where there is none to write (`path` None): then none of
    what describes it may be given."""
    if path is None:
        if (run_dir, model, labels, text_column, label_column) != (None, None, None, None, "label"):
            raise InputError(
                "--run-dir, --model, --labels, --label-column and --text-column describe the config "
                "--write-config writes: give it"
            )
        return None
    return JobConfig(path, run_dir, model, labels, label_column, text_column)


def recommend_k(
    input: str,
    write_config: str | None = None,
    *,
    run_dir: str | None = None,
    model: str | None = None,
    labels: tuple[str, ...] | None = None,
    label_column: str = "label",
    text_column: str | None = None,
    **options: Any,
) -> Recommendation:
    """Sweep the contribution bound k: records kept against noise at each k, and the k to choose.

    The step `madp recommend-k` runs: for each k, bound the input's graph (the local kernels), check that
    the sampler reaches the batch size and calibrate sigma to (epsilon, delta); the excess-risk proxy
    (bias: records dropped; variance: the noise of the mean gradient) recommends a feasible k. With
    `write_config`, the `madp run` config of the recommended k is written there, and the sweep beside its
    run (RUN_DIR/recommend-k.json).

    Args:
        input: the records, a .jsonl/.parquet file or a directory of them.
        write_config: the `madp run` config (JOB.yaml) to write for the recommended k (None: none).
        run_dir: the written config's run_dir (default: JOB-output beside JOB.yaml).
        model: the written config's train.model (default: logreg, or a text model on a text column).
        labels: the public label set of a text-classifier config.
        label_column: the written config's label column.
        text_column: the written config's text column (default text, else body).
        **options: the sweep's options, the fields of `madp.tools.planning.recommend.Sweep`: epsilon, delta,
            steps (T) and batch_size (B), all required; mechanism ("dpsgd", "bandmf"), min_sep, bands,
            strategy, clip_norm, ks (the bounds to try, a tuple), order, seed, columns,
            truncation_share.

    Returns:
        The sweep, a `madp.tools.planning.recommend.Recommendation` (frozen; `to_json()` is recommend-k.json's
        content): `sweep` (one `SweepRow` per k: records kept, sigma, the excess risk, feasible, the
        problems of an infeasible k), `recommended_k` (None where no k is feasible), `reason`; with
        write_config, `config` (the written path, None where nothing was written) and `wrote_config`.

    Raises:
        TypeError: an option the sweep does not have (the error lists those it has).
        madp.core.errors.InputError: bad options, an unreadable input, a column the written config names
            that the input lacks, a config that cannot be written; the message names the option or file.

    Example:
        >>> import madp, tempfile
        >>> from madp.tools.data.synthetic import GraphSpec, generate, write_dataset
        >>> work, spec = tempfile.mkdtemp(), GraphSpec(records=1000, seed=1)
        >>> _ = write_dataset(generate(spec), spec, f"{work}/records.parquet", shards=1)
        >>> result = madp.recommend_k(
        ...     f"{work}/records.parquet", epsilon=8, delta=1e-5, steps=100, batch_size=16,
        ...     mechanism="bandmf", min_sep=4, bands=2, ks=(1, 2, 4),
        ... )
        >>> [(row.k, row.feasible) for row in result.sweep], result.recommended_k
        ([(1, True), (2, True), (4, True)], 1)
    """
    sweep = options_of("recommend_k", Sweep, options)
    return run_recommend_k(input, sweep, job_config_of(write_config, run_dir, model, labels, label_column, text_column))


def run_recommend_k(
    input: str, sweep: Sweep, config: JobConfig | None, show: Callable[[Recommendation], None] | None = None
) -> Recommendation:
    """`recommend_k` with its sweep built (`madp recommend-k` builds it from its arguments); `show` sees the
    sweep's result before a config is written (the command prints its table)."""
    train = (
        None
        if config is None
        else train_section(input, sweep.columns, config.model, config.labels, config.label_column, config.text_column)
    )
    result = recommend(input, sweep)
    if show is not None:
        show(result)
    if config is None:
        return result
    row = result.recommended
    if row is None:
        log.error("--write-config %s: not written, no swept k is feasible (see the problems above)", config.path)
        return dataclasses.replace(result, wrote_config=False)
    path = os.path.abspath(config.path)
    run_dir = config.run_dir or os.path.splitext(path)[0] + "-output"
    data = input if "://" in input else os.path.abspath(input)
    assert train is not None  # made with the config
    write_job_config(path, job_config(row, sweep, data, run_dir, train), row.k)
    result = dataclasses.replace(result, config=path, wrote_config=True)
    write_sweep(run_dir, result)  # `madp report` of the run plots it
    log.info("wrote %s: `madp run %s` runs the job of k = %d", path, config.path, row.k)
    return result
