"""`madp recommend-k`: sweep the contribution bound k on one in-memory read of the input.

A larger k keeps more records (less bias towards records with few users: bias-variance paper;
It's my data too, Sec. 5.2) but each user then owns up to k records of a batch, so sigma grows
(group privacy inside DP-SGD's mixture of Gaussians, or k records per step in BandMF). Per k the
sweep reports both sides, from the bounding kernels and the accountant; the recommendation is the
ELS paper's heuristic (Sec. 6): k = the median number of records per user, among the swept k.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pyarrow.compute as pc

from madp.accounting.calibrate import calibrate
from madp.accounting.mechanisms import BandMf, DpSgd, Mechanism, sampling_probability
from madp.accounting.strategies import coefficients as strategy_coefficients
from madp.core import records as rec
from madp.core.bounding import Capacities
from madp.core.errors import InputError
from madp.core.selection import BoundOptions
from madp.engines.local_engine import bound_records, read_input

log = logging.getLogger("madp.recommend")
DEFAULT_KS = (1, 2, 3, 4, 6, 8, 12, 16)


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

    def __post_init__(self) -> None:
        if self.mechanism not in ("dpsgd", "bandmf"):
            raise InputError("--mechanism must be dpsgd or bandmf")
        if not self.ks or any(not isinstance(k, int) or k < 1 for k in self.ks):
            raise InputError(f"--k must list integers >= 1, got {self.ks}")
        if self.mechanism == "dpsgd" and (self.min_sep != 1 or self.bands != 1):
            raise InputError("--mechanism dpsgd is plain Poisson sampling: --min-sep 1 and --bands 1")
        if self.clip_norm <= 0:
            raise InputError("--clip-norm must be positive")


def records_per_user(user_index: np.ndarray, weights: np.ndarray, users: int) -> np.ndarray:
    """sum of `weights` (copies) of the records each user appears in."""
    return np.bincount(user_index, weights=weights, minlength=users).astype(np.int64)


def recommend(input_path: str, sweep: Sweep) -> dict:
    chunk, rejects, _, _ = read_input(input_path, sweep.columns)
    if len(rejects):
        raise InputError(
            f"{input_path}: {len(rejects)} invalid rows (first: {rejects.file[0]} row "
            f"{rejects.row[0]}, {rejects.reason[0]}); fix them, or sweep the selection of a "
            f"`madp bound --on-invalid skip` run's input without them"
        )
    arity = chunk.arity
    user_index = pc.dictionary_encode(chunk.users).indices.to_numpy(zero_copy_only=False).astype(np.int64)
    users = int(user_index.max()) + 1 if len(user_index) else 0
    incidence_record = np.repeat(np.arange(len(chunk)), arity)
    before = records_per_user(user_index, np.ones(len(user_index)), users)
    median = float(np.median(before)) if users else 0.0
    log.info("%d records, %d users, median %g records per user", len(chunk), users, median)
    rows = []
    for k in sorted(set(sweep.ks)):
        kept = {}
        for duplicates in (False, True):
            options = BoundOptions(
                max_contributions=k, order=sweep.order, seed=sweep.seed, duplicates=duplicates, columns=sweep.columns
            )
            kept[duplicates] = bound_records(chunk, options, Capacities(default=k)).copies
        distinct = kept[False] > 0
        after = records_per_user(user_index, kept[False][incidence_record], users)
        sigma, epsilon = _noise(sweep, k, int(kept[False].sum()))
        rows.append(
            {
                "k": k,
                "kept_records": int(distinct.sum()),
                "kept_fraction": round(float(distinct.mean()), 6) if len(chunk) else 0.0,
                "kept_records_with_duplicates": int(kept[True].sum()),
                "users_capped_fraction": round(float((before > k).mean()), 6) if users else 0.0,
                "users_at_bound_fraction": round(float((after == k).mean()), 6) if users else 0.0,
                "mean_users_per_kept_record": round(float(arity[distinct].mean()), 6) if distinct.any() else 0.0,
                "noise_multiplier": sigma,
                "epsilon": epsilon,
                "noise_std_over_batch": sigma * sweep.clip_norm / sweep.batch_size,
            }
        )
        log.info(
            "k = %d: keeps %d records (%.1f%%), sigma %.4g",
            k,
            rows[-1]["kept_records"],
            100 * rows[-1]["kept_fraction"],
            sigma,
        )
    chosen = min(rows, key=lambda row: (abs(row["k"] - median), row["k"]))
    return {
        "input": {
            "path": input_path,
            "records": len(chunk),
            "users": users,
            "mean_users_per_record": round(float(arity.mean()), 6) if len(chunk) else 0.0,
            "median_records_per_user": median,
            "records_per_user_quantiles": {str(q): float(np.quantile(before, q)) for q in (0.5, 0.9, 0.99, 1.0)}
            if users
            else {},
        },
        "parameters": {**dataclasses.asdict(sweep), "columns": None},
        "sweep": rows,
        "recommended_k": chosen["k"],
        "reason": _reason(chosen, rows, median),
    }


def _noise(sweep: Sweep, k: int, units: int) -> tuple[float, float]:
    """(sigma, epsilon) for batches of `sweep` over data bounded at k with `units` sampling units."""
    mechanism: Mechanism
    if sweep.mechanism == "dpsgd":
        mechanism = DpSgd(sampling_probability(sweep.batch_size, units), sweep.steps, k)
    else:
        bands = tuple(strategy_coefficients(sweep.strategy, sweep.steps, sweep.bands).tolist())
        mechanism = BandMf(
            sweep.steps, sweep.min_sep, 1 + (sweep.steps - 1) // sweep.min_sep, bands, records_per_step=k
        )
    # A sweep needs sigma to ~1%: a 10x coarser PLD grid than `madp calibrate` (still an upper bound on
    # epsilon) makes it ~7x faster; the final run calibrates on the fine grid.
    result = calibrate(mechanism, sweep.epsilon, sweep.delta, relative_tolerance=1e-2, discretization=1e-2)
    return result.noise_multiplier, result.epsilon


def _reason(chosen: dict, rows: list[dict], median: float) -> str:
    text = (
        f"the median user has {median:g} records (ELS heuristic, Sec. 6); at k = {chosen['k']} the bound keeps "
        f"{100 * chosen['kept_fraction']:.1f}% of the records with noise std {chosen['noise_std_over_batch']:.3g} "
        f"of the averaged gradient (sigma {chosen['noise_multiplier']:.3g})"
    )
    larger = [row for row in rows if row["k"] > chosen["k"]]
    if larger:
        nxt = larger[0]
        text += (
            f"; k = {nxt['k']} would keep {100 * (nxt['kept_fraction'] - chosen['kept_fraction']):.1f} points "
            f"more for {nxt['noise_multiplier'] / chosen['noise_multiplier']:.2f}x the noise"
        )
    return text
