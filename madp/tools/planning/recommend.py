"""`madp recommend-k`: sweep the contribution bound k on one in-memory read of the input, and check
what the job will need at each k (`madp.tools.planning.feasibility`, the check `madp run` makes of its own
k before it bounds).

Under the fixed-graph model the user-record graph is public, so everything here is computed from the
graph alone and costs no privacy: per k, the records and users the bound keeps, the largest expected
batch size b-min-sep sampling reaches on that selection (and the p it needs), the truncation delta at
the target epsilon with the smallest `--max-batch-size` that keeps it within a stated share of delta,
sigma from the accountant, and the noise of the mean gradient.

Choosing k (bias-variance paper; It's my data too, Sec. 5.2): a larger k keeps more records, so the
model is trained on more of the data distribution (less bias), but each user then owns up to k records
of a batch, so sigma grows (group privacy inside DP-SGD's mixture of Gaussians, or k records per step
in BandMF) and the noise of every step with it (more variance). The recommendation minimizes an
explicit proxy of the expected excess risk, `ExcessRisk`, over the feasible k:

    bias     = 1 - kept fraction of records   the share of the training distribution the model never
                                               sees: its excess risk on it is up to the loss range, so
                                               bias bounds it in units of that range (a total-variation
                                               bound between the kept and all records)
    variance = T (sigma / B)^2                 the variance of the noise summed over the T steps of
                                               the mean gradient (sigma C / B per step), in units of
                                               the clip norm C: what the noisy updates add to the
                                               parameters, relative to the largest a mean gradient is
    risk     = bias + variance

The two terms move in opposite directions with k, so their sum has an interior minimum wherever both
matter; the weights are a convention (one unit of loss range per unit of clipped-gradient variance),
which is why every term is reported. The ELS paper's heuristic (Sec. 6: k = the median number of
records per user) stays a reported column.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import yaml

from madp.accounting.calibrate import calibrate
from madp.accounting.mechanisms import BandMf, DpSgd, Mechanism
from madp.accounting.strategies import coefficients as strategy_coefficients
from madp.accounting.truncation import REFUSED_SHARE
from madp.core import record_reading, storage
from madp.core import records as rec
from madp.core.bounding import Capacities
from madp.core.errors import InputError, OptionError, positive
from madp.core.options import flag_of
from madp.core.reports import VERSION_KEY, check_format
from madp.core.selection import BoundOptions
from madp.engines.local_engine import bound_records, read_input
from madp.tools.planning.feasibility import (
    DEFAULT_TRUNCATION_SHARE,
    BatchFeasibility,
    BatchTarget,
    Graph,
    batch_feasibility,
    graph_of,
)

log = logging.getLogger("madp.recommend")
DEFAULT_KS = (1, 2, 3, 4, 6, 8, 12, 16)


# --- the criterion ----------------------------------------------------------------------------------


class ExcessRisk(NamedTuple):
    """The proxy of expected excess risk the recommendation minimizes (module docstring)."""

    bias: float  # 1 - kept fraction of records
    variance: float  # T (sigma / B)^2: the mean gradient's noise over training, in units of C
    total: float


def excess_risk(kept_fraction: float, noise_multiplier: float, batch_size: float, steps: int) -> ExcessRisk:
    bias = 1.0 - kept_fraction
    variance = steps * (noise_multiplier / batch_size) ** 2
    return ExcessRisk(bias, variance, bias + variance)


# --- the sweep ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sweep:
    epsilon: float
    delta: float
    steps: int
    batch_size: float
    mechanism: str = "dpsgd"  # dpsgd, or bandmf (unamplified, b-min-sep Poisson batches)
    min_sep: int = 1
    bands: int = 1
    strategy: str = "sqrt"
    clip_norm: float = 1.0
    ks: tuple[int, ...] = DEFAULT_KS
    order: str = "arity"
    seed: int = 0
    columns: rec.Columns = rec.Columns()
    truncation_share: float = DEFAULT_TRUNCATION_SHARE

    def __post_init__(self) -> None:
        if self.mechanism not in ("dpsgd", "bandmf"):
            raise InputError("--mechanism must be dpsgd or bandmf")
        if not self.ks or any(not isinstance(k, int) or k < 1 for k in self.ks):
            raise InputError(f"--k must list integers >= 1, got {self.ks}")
        if self.mechanism == "dpsgd" and (self.min_sep != 1 or self.bands != 1):
            raise InputError("--mechanism dpsgd is plain Poisson sampling: --min-sep 1 and --bands 1")
        if self.mechanism == "bandmf" and not 1 <= self.bands <= self.min_sep:
            raise InputError(f"--mechanism bandmf needs 1 <= --bands <= --min-sep, got {self.bands} and {self.min_sep}")
        if not positive(self.clip_norm):
            raise InputError("--clip-norm must be positive and finite")
        if self.steps < 1 or not positive(self.batch_size):
            raise InputError("--steps must be at least 1 and --batch-size positive and finite")
        if not positive(self.epsilon) or not 0 < self.delta < 1:
            raise InputError("--epsilon must be positive and finite, and --delta in (0, 1)")
        if not 0 < self.truncation_share < REFUSED_SHARE:
            raise InputError(
                f"--truncation-share must be in (0, {REFUSED_SHARE:g}): calibration refuses a truncation that "
                f"takes {REFUSED_SHARE:.0%} of delta or more"
            )

    @property
    def target(self) -> BatchTarget:
        return BatchTarget(
            self.steps,
            self.batch_size,
            self.min_sep,
            self.delta,
            self.epsilon,
            accounts_truncation=self.mechanism == "dpsgd",  # madp train's auto: DP-SGD, amplified
            truncation_share=self.truncation_share,
            bands=self.bands,
        )


def records_per_user(user_index: np.ndarray, weights: np.ndarray, users: int) -> np.ndarray:
    """sum of `weights` (copies) of the records each user appears in."""
    return np.bincount(user_index, weights=weights, minlength=users).astype(np.int64)


def _read_graph_input(input_path: str, columns: rec.Columns) -> rec.RecordChunk:
    chunk, rejects, _, _ = read_input(input_path, columns)
    if len(rejects):
        raise InputError(
            f"{input_path}: {len(rejects)} invalid rows (first: {rejects.file[0]} row "
            f"{rejects.row[0]}, {rejects.reason[0]}); fix them, or sweep the selection of a "
            f"`madp bound --on-invalid skip` run's input without them"
        )
    return chunk


SWEEP_FORMAT_VERSION = 1  # of recommend-k.json; a file without the key is its predecessor (the same keys)


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One k of the sweep: what the bound keeps, what the sampler reaches on it, sigma, the excess-risk proxy's
    terms (None where the k is infeasible before the accountant), and why it is infeasible, if it is."""

    k: int  # the contribution bound swept
    kept_records: int  # distinct records the bound at k keeps
    kept_fraction: float  # kept_records over the input's records
    kept_records_with_duplicates: int  # records kept counting the with-duplicates variant's copies
    kept_users: int  # users with at least one kept record
    kept_users_fraction: float  # kept_users over the input's users
    users_capped_fraction: float  # users with more than k records (the bound drops some of theirs)
    users_at_bound_fraction: float  # users left with exactly k records
    mean_users_per_kept_record: float  # mean number of users of a kept record
    largest_batch_size: float  # the largest expected batch the sampler reaches at k
    largest_batch_sampling_probability: float  # the sampling probability that reaches it
    sampling_probability: float | None  # p at the target batch size (None: infeasible)
    max_batch_size: int | None  # the truncation of a step's rows the planned job uses (None: none)
    truncation_delta: float  # the delta the truncation costs
    noise_multiplier: float | None  # sigma for the target epsilon (None: not accounted)
    epsilon: float | None  # the epsilon accounted at that sigma
    noise_std_over_batch: float | None  # sigma times the clip norm over the batch size: the noise per averaged gradient
    bias: float | None  # the excess-risk proxy's bias term (records the bound drops)
    variance: float | None  # its variance term (the noise)
    excess_risk: float | None  # bias plus variance: what the criterion minimizes
    feasible: bool  # whether the sampler and the accountant can run a job at k
    problems: tuple[str, ...]  # why not, one line per problem
    median_heuristic: bool = False  # the swept k nearest the median records per user (ELS, Sec. 6)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "problems": list(self.problems)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SweepRow:
        return cls(**{**data, "problems": tuple(data["problems"])})


@dataclasses.dataclass(frozen=True)
class SweptInput:
    """The input's graph as the sweep read it: its records, users and how many records a user has."""

    path: str  # the input swept
    records: int  # valid input records
    users: int  # distinct users
    mean_users_per_record: float  # mean users of a record
    median_records_per_user: float  # median records of a user
    records_per_user_quantiles: Mapping[str, float]  # {quantile: records}, e.g. {"0.9": 12.0}

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "records_per_user_quantiles": dict(self.records_per_user_quantiles)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SweptInput:
        return cls(**{**data, "records_per_user_quantiles": dict(data["records_per_user_quantiles"])})


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What `madp recommend-k` returns, prints and writes beside the run it planned (recommend-k.json): the
    input, the sweep's options, one row per k, the k the criterion recommends (None where none is feasible)
    and why, and the median heuristic's k; with --write-config, the config written (None where none was:
    then `ok` is False)."""

    input: SweptInput  # the input's graph as read
    parameters: Mapping[str, Any]  # the sweep's options as given (its columns left out)
    criterion: str  # how the recommended k is chosen
    sweep: tuple[SweepRow, ...]  # one row per k swept
    recommended_k: int | None  # the feasible k of least excess risk (None: none feasible)
    median_heuristic_k: int  # the k the median heuristic gives, for comparison
    reason: str  # why recommended_k (or none)
    config: str | None = None  # the madp run config written, its path (None: none asked for, or none feasible)
    wrote_config: bool | None = None  # None: no config was asked for; False: asked for, none feasible

    @property
    def recommended(self) -> SweepRow | None:
        """The row of the recommended k."""
        return next((row for row in self.sweep if row.k == self.recommended_k), None)

    def to_json(self) -> dict[str, Any]:
        """recommend-k.json's content: what `madp recommend-k` prints, after the file's format_version."""
        result: dict[str, Any] = {
            VERSION_KEY: SWEEP_FORMAT_VERSION,
            "input": self.input.to_json(),
            "parameters": dict(self.parameters),
            "criterion": self.criterion,
            "sweep": [row.to_json() for row in self.sweep],
            "recommended_k": self.recommended_k,
            "median_heuristic_k": self.median_heuristic_k,
            "reason": self.reason,
        }
        if self.wrote_config is False:
            result.update(ok=False, config=None)
        elif self.wrote_config:
            result["config"] = self.config
        return result

    @classmethod
    def from_json(cls, data: Any, where: str) -> Recommendation:
        """The sweep of a parsed recommend-k.json (`where` names it in errors)."""
        check_format(data, where, "recommend-k sweep", SWEEP_FORMAT_VERSION)
        try:
            return cls(
                input=SweptInput.from_json(data["input"]),
                parameters=dict(data["parameters"]),
                criterion=data["criterion"],
                sweep=tuple(SweepRow.from_json(row) for row in data["sweep"]),
                recommended_k=data["recommended_k"],
                median_heuristic_k=data["median_heuristic_k"],
                reason=data["reason"],
                config=data.get("config"),
                wrote_config=None if "config" not in data else data.get("ok") is not False,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise InputError(
                f"{where} is not a madp recommend-k sweep this madp reads ({type(error).__name__}: {error}); "
                f"run madp recommend-k again"
            ) from None


def recommend(input_path: str, sweep: Sweep) -> Recommendation:
    """The sweep's rows (one per k, feasible or with the reasons it is not), the k the excess-risk
    proxy recommends among the feasible ones, and the median heuristic's k; it never stops at a k."""
    chunk = _read_graph_input(input_path, sweep.columns)
    graph = graph_of(chunk)
    before = records_per_user(graph.user_of_incidence, np.ones(len(graph.user_of_incidence)), graph.users)
    median = float(np.median(before)) if graph.users else 0.0
    log.info("%d records, %d users, median %g records per user", len(chunk), graph.users, median)
    rows = [_row(chunk, graph, before, sweep, k) for k in sorted(set(sweep.ks))]
    median_k = min(rows, key=lambda row: (abs(row.k - median), row.k)).k
    rows = [dataclasses.replace(row, median_heuristic=row.k == median_k) for row in rows]
    candidates = [row for row in rows if row.feasible]
    chosen = min(candidates, key=lambda row: (_scored(row)[1].total, row.k)) if candidates else None
    return Recommendation(
        input=SweptInput(
            path=input_path,
            records=len(chunk),
            users=graph.users,
            mean_users_per_record=round(float(graph.arity.mean()), 6) if len(chunk) else 0.0,
            median_records_per_user=median,
            records_per_user_quantiles={str(q): float(np.quantile(before, q)) for q in (0.5, 0.9, 0.99, 1.0)}
            if graph.users
            else {},
        ),
        parameters={**dataclasses.asdict(sweep), "ks": list(sweep.ks), "columns": None},  # as JSON holds them
        criterion="minimum over the feasible k of bias + variance = (1 - kept fraction of records) + "
        "T (sigma / B)^2 (a proxy of expected excess risk; see madp/tools/planning/recommend.py)",
        sweep=tuple(rows),
        recommended_k=chosen.k if chosen else None,
        median_heuristic_k=median_k,
        reason=_reason(chosen, rows, median, median_k, sweep),
    )


def _row(chunk: rec.RecordChunk, graph: Graph, before: np.ndarray, sweep: Sweep, k: int) -> SweepRow:
    kept = {}
    for duplicates in (False, True):
        options = BoundOptions(max_contributions=k, order=sweep.order, seed=sweep.seed, duplicates=duplicates)
        kept[duplicates] = bound_records(chunk, options, Capacities(default=k)).copies
    distinct = kept[False] > 0
    after = records_per_user(graph.user_of_incidence, kept[False][graph.record_of_incidence], graph.users)
    batches = batch_feasibility(graph, kept[False], k, sweep.target)
    problems = list(batches.problems)
    sigma: float | None = None
    epsilon: float | None = None
    if batches.sampling_probability is not None or sweep.mechanism == "bandmf":  # BandMF's sigma needs no p
        try:
            sigma, epsilon = _noise(sweep, k, batches)
        except OptionError as error:  # the file names options by their flags, as the command line does
            problems.append(f"calibration: {error.named(flag_of)}")
        except InputError as error:
            problems.append(f"calibration: {error}")
    kept_fraction = float(distinct.mean()) if len(chunk) else 0.0
    risk = excess_risk(kept_fraction, sigma, sweep.batch_size, sweep.steps) if sigma is not None else None
    row = SweepRow(
        k=k,
        kept_records=int(distinct.sum()),
        kept_fraction=round(kept_fraction, 6),
        kept_records_with_duplicates=int(kept[True].sum()),
        kept_users=int((after > 0).sum()),
        kept_users_fraction=round(float((after > 0).mean()), 6) if graph.users else 0.0,
        users_capped_fraction=round(float((before > k).mean()), 6) if graph.users else 0.0,
        users_at_bound_fraction=round(float((after == k).mean()), 6) if graph.users else 0.0,
        mean_users_per_kept_record=round(float(graph.arity[distinct].mean()), 6) if distinct.any() else 0.0,
        largest_batch_size=round(batches.reach.largest, 3),
        largest_batch_sampling_probability=batches.reach.probability,
        sampling_probability=batches.sampling_probability,
        max_batch_size=batches.max_batch_size,
        truncation_delta=batches.truncation_delta,
        noise_multiplier=sigma,
        epsilon=epsilon,
        noise_std_over_batch=None if sigma is None else sigma * sweep.clip_norm / sweep.batch_size,
        bias=None if risk is None else round(risk.bias, 6),
        variance=None if risk is None else round(risk.variance, 6),
        excess_risk=None if risk is None else round(risk.total, 6),
        feasible=not problems,
        problems=tuple(problems),
    )
    log.info(
        "k = %d: keeps %d records (%.1f%%), sigma %s%s",
        k,
        row.kept_records,
        100 * kept_fraction,
        "-" if sigma is None else f"{sigma:.4g}",
        "" if not problems else f"; infeasible: {'; '.join(problems)}",
    )
    return row


def _noise(sweep: Sweep, k: int, batches: BatchFeasibility) -> tuple[float, float]:
    """(sigma, epsilon) of the training `madp train` would run on these batches, its truncation's share
    of delta set aside as calibration sets it aside."""
    mechanism: Mechanism
    if sweep.mechanism == "dpsgd":
        assert batches.sampling_probability is not None  # the caller asks only for reachable batches
        mechanism = DpSgd(batches.sampling_probability, sweep.steps, k)
    else:
        bands = tuple(strategy_coefficients(sweep.strategy, sweep.steps, sweep.bands).tolist())
        mechanism = BandMf(
            sweep.steps, sweep.min_sep, 1 + (sweep.steps - 1) // sweep.min_sep, bands, records_per_step=k
        )
    # A sweep needs sigma to ~1%: a 10x coarser PLD grid than `madp calibrate` (still an upper bound on
    # epsilon) makes it ~7x faster; the final run calibrates on the fine grid.
    result = calibrate(
        mechanism,
        sweep.epsilon,
        sweep.delta - batches.truncation_delta,
        relative_tolerance=1e-2,
        discretization=1e-2,
    )
    return result.noise_multiplier, result.epsilon


def _reason(chosen: SweepRow | None, rows: list[SweepRow], median: float, median_k: int, sweep: Sweep) -> str:
    if chosen is None:
        first = rows[0]
        return f"no swept k is feasible (each row says why), e.g. k = {first.k}: {first.problems[0]}"
    # a feasible row has passed the accountant: its sigma and proxy are there
    sigma, risk = _scored(chosen)
    text = (
        f"k = {chosen.k} has the smallest excess-risk proxy among the feasible k: bias (1 - kept fraction) "
        f"{risk.bias:.3g} + variance (T (sigma/B)^2, sigma {sigma:.3g}) "
        f"{risk.variance:.3g} = {risk.total:.3g}; it keeps {100 * chosen.kept_fraction:.1f}% "
        f"of the records with noise std {chosen.noise_std_over_batch:.3g} of the averaged gradient"
    )
    scored = [row for row in rows if row.excess_risk is not None]
    at = scored.index(chosen)
    for row in scored[max(at - 1, 0) : at] + scored[at + 1 : at + 2]:  # the scored k on either side
        other_sigma, other = _scored(row)
        text += (
            f"; k = {row.k}: {100 * (row.kept_fraction - chosen.kept_fraction):+.1f} points kept, "
            f"{other_sigma / sigma:.2f}x the noise, risk {other.total:.3g}"
        )
    text += f"; the median user has {median:g} records (ELS heuristic, Sec. 6: k = {median_k})"
    if chosen is scored[-1] and len(scored) > 1 and _scored(scored[-2])[1].total > risk.total:
        text += (
            f"; k = {chosen.k} is the largest k swept and the proxy was still falling there: sweep larger "
            f"k too (--k {','.join(str(row.k) for row in rows)},{2 * chosen.k},{4 * chosen.k})"
        )
    infeasible = [row.k for row in rows if not row.feasible]
    if infeasible:
        text += f"; infeasible: k = {', '.join(map(str, infeasible))} (see their problems)"
    return text


def _scored(row: SweepRow) -> tuple[float, ExcessRisk]:
    """The sigma and excess-risk proxy of a row the accountant calibrated."""
    assert row.noise_multiplier is not None and row.bias is not None and row.variance is not None
    assert row.excess_risk is not None
    return row.noise_multiplier, ExcessRisk(row.bias, row.variance, row.excess_risk)


# --- the table and the config ---------------------------------------------------------------------


def table(result: Recommendation) -> str:
    """The sweep as a fixed-width table, then the problems of the infeasible rows and the reason."""
    header = ["k", "kept", "kept%", "users", "max E|B|", "p", "B_max", "trunc.delta", "sigma", "sigma C/B"]
    header += ["bias", "variance", "risk", ""]
    lines: list[list[str]] = [header]
    for row in result.sweep:
        marks = []
        if row.k == result.recommended_k:
            marks.append("<- recommended")
        if row.median_heuristic:
            marks.append("median heuristic")
        if not row.feasible:
            marks.append("INFEASIBLE")
        lines.append(
            [
                str(row.k),
                str(row.kept_records),
                f"{100 * row.kept_fraction:.1f}",
                str(row.kept_users),
                f"{math.floor(10 * row.largest_batch_size) / 10:.1f}",  # as the problems say it: reachable
                _figure(row.sampling_probability),
                "-" if row.max_batch_size is None else str(row.max_batch_size),
                _figure(row.truncation_delta),
                _figure(row.noise_multiplier),
                _figure(row.noise_std_over_batch),
                _figure(row.bias),
                _figure(row.variance),
                _figure(row.excess_risk),
                ", ".join(marks),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    for row in result.sweep:
        text += [f"k = {row.k}: {problem}" for problem in row.problems]
    text.append(f"criterion: {result.criterion}")
    text.append(f"recommended k = {result.recommended_k}: {result.reason}")
    return "\n".join(text)


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


TEXT_COLUMNS = ("text", "body")  # `madp generate --task text`, `madp import-mbox`


def train_section(
    input_path: str,
    columns: rec.Columns,
    model: str | None,
    labels: tuple[str, ...] | None,
    label_column: str = "label",
    text_column: str | None = None,
) -> dict[str, Any]:
    """A train section for the input's content columns: logreg on `features` and `label_column`; on a text
    column (`text_column`, else `text` or an mbox's `body`) a text classifier where the public label set is
    given (`labels`: the trainer never reads it from the private records), else a byte-level language
    model, which needs none; `model` overrides the choice. A named column the input lacks is refused."""
    content = record_reading.content_columns(rec.list_input_files(input_path)[0], columns)
    listed = ", ".join(content) or "(none)"
    if text_column is not None and text_column not in content:
        raise InputError(f"--text-column {text_column}: the input has no such column (its content columns: {listed})")
    text = text_column or next((name for name in TEXT_COLUMNS if name in content), None)
    if labels and label_column not in content:
        raise InputError(
            f"--labels: the input has no label column {label_column!r} (its content columns: {listed}): name it "
            f"with --label-column"
        )
    if model is None:
        if "features" in content and label_column in content:
            model = "logreg"
        elif text is not None:
            model = "text-classifier" if labels else "text-lm"
        else:
            raise InputError(
                f"--write-config: no model is known to train on the columns {listed}: "
                f"give --model (logreg, mlp, text-classifier, text-lm or module:function)"
            )
    section: dict[str, Any] = {"model": model}
    if model.startswith("text-") and text is not None:
        section["text_column"] = text
    if model == "text-classifier":
        if not labels:
            raise InputError(
                "--model text-classifier: give --labels, the public label set (DP training never reads it from "
                "the records: which labels occur would disclose them)"
            )
        section.update(label=label_column, labels=list(labels))
    elif label_column != "label" and not model.startswith("text-"):
        section["label"] = label_column
    return section


def job_config(row: SweepRow, sweep: Sweep, input_path: str, run_dir: str, train: dict[str, Any]) -> dict[str, Any]:
    """The `madp run` config of the recommended k (its `row`): bound, batch, calibrate and train as the sweep
    checked them (B_max where truncation is accounted: the smallest within the stated share)."""
    columns = sweep.columns
    bound: dict[str, Any] = {"max_contributions": row.k}
    if columns.id != "id":
        bound["id_column"] = columns.id
    if columns.users_columns:
        bound["users_columns"] = list(columns.users_columns)
    elif columns.users != "users":
        bound["users_column"] = columns.users
    if columns.user_ids is not None:
        bound["user_ids"] = columns.user_ids
    if sweep.order != "arity":
        bound["order"] = sweep.order
    if sweep.seed:
        bound["seed"] = sweep.seed
    bound["runner"] = "local"
    batch_size = int(sweep.batch_size) if float(sweep.batch_size).is_integer() else sweep.batch_size
    batch: dict[str, Any] = {"steps": sweep.steps, "batch_size": batch_size, "min_sep": sweep.min_sep}
    if row.max_batch_size is not None:
        batch["max_batch_size"] = row.max_batch_size
    batch["runner"] = "local"
    calibrate_: dict[str, Any] = {"epsilon": sweep.epsilon, "delta": sweep.delta, "mechanism": sweep.mechanism}
    if sweep.mechanism == "bandmf":
        calibrate_.update(bands=sweep.bands, strategy=sweep.strategy)
    calibrate_["clip_norm"] = sweep.clip_norm
    return {
        "run_dir": run_dir,
        "input": input_path,
        "bound": bound,
        "batch": batch,
        "calibrate": calibrate_,
        "train": train,
    }


def write_config(path: str, config: dict[str, Any], k: int) -> None:
    header = (
        f"# Written by `madp recommend-k`: k = {k} by the excess-risk proxy "
        f"(bias + variance, madp/tools/planning/recommend.py).\n"
        f"# `madp run {os.path.basename(path)}` runs it; runner local bounds and batches in this process "
        f"(DirectRunner, DataflowRunner, ... for Beam: see runners/).\n"
    )
    try:
        with open(path, "w") as handle:
            handle.write(header + yaml.safe_dump(config, sort_keys=False))
    except OSError as error:
        raise InputError(f"--write-config {path}: cannot write it ({error.strerror})") from error


SWEEP_FILE = "recommend-k.json"  # in the run directory of the config written: `madp report` plots it


def write_sweep(run_dir: str, result: Recommendation) -> None:
    """The sweep beside the run it planned (`RUN_DIR/recommend-k.json`). A function of the graph and the
    public parameters only (no content, no sampling), as the bound's report is: `madp report` shows
    its curve on the published page."""
    text = json.dumps(result.to_json(), indent=2, default=str) + "\n"
    storage.write_text(storage.join(run_dir, SWEEP_FILE), text)
