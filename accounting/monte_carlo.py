"""Monte Carlo accounting kernels for BandMF with (multi-attribution) b-min-sep Poisson sampling.

The worst case of one user is the matrix mechanism y = C x + z, z ~ N(0, sigma^2 I) (P), against
y = z (Q). Under P the user is available at step i unless it participated in the previous b - 1
steps; when available it contributes x_i ~ Binomial(k_u, p) records (k_u = 1: Alg. 1 of the
b-min-sep paper; k_u > 1: Sec. 6.2). The likelihood ratio P(y)/Q(y) is f_1 of the backward
recursion (eq. (1), extended to Binomial counts):

    f_i = Binom(0) f_{i+1} + sum_{j>=1} Binom(j) r_i(j) f_{i+b},   f_i = 1 for i > T,
    r_i(j) = exp((j <c_i, y_i..y_{i+b-1}> - j^2 ||c_i||^2 / 2) / sigma^2),

with c_i the nonzero part of column i of C. Samples are vectorized in blocks of samples; steps
are consumed backwards in cache-sized tiles, b steps at a time as one small matrix product, in
linear space with per-sample rescaling (log space when Binom(0) is too small for that to be
exact). Estimate-verify-release (`accounting/evr.py`) turns these estimates into a formal guarantee.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numpy.lib.stride_tricks import as_strided
from scipy.stats import binom
from threadpoolctl import threadpool_limits

from accounting.mechanisms import check_contributions, check_min_sep, check_probability, check_steps
from madp.records import InputError


@dataclasses.dataclass(frozen=True)
class MinSepProcess:
    """One user's participation process: T steps, min-sep b, probability p, up to k_u records."""
    steps: int
    min_sep: int
    sampling_prob: float
    max_contributions: int
    coefficients: tuple[float, ...]  # bands of C, len <= min_sep

    def __post_init__(self) -> None:
        check_steps(self.steps)
        check_min_sep(self.min_sep, len(self.coefficients))
        check_probability("--sampling-prob", self.sampling_prob)
        check_contributions(self.max_contributions)
        if min(self.coefficients, default=0.0) < 0:
            raise InputError(f"b-min-sep amplification (Theorem 6.1 of the b-min-sep paper) needs a non-negative "
                             f"strategy matrix C; these bands have negative entries {self.coefficients}: use "
                             f"--strategy sqrt, or account without amplification")

    @property
    def count_log_probs(self) -> np.ndarray:
        """log Binomial(j; k_u, p) for j = 0..k_u."""
        return binom.logpmf(np.arange(self.max_contributions + 1), self.max_contributions, self.sampling_prob)


def sample_participations(process: MinSepProcess, samples: int,
                          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, sample, records) of every participation, by waiting times between participations.

    At each available step the user takes part with probability p' = P(Binomial(k_u, p) >= 1),
    so the wait to its next participation is Geometric(p'); after one it is unavailable for
    b - 1 steps; the record count is Binomial(k_u, p) conditioned on being >= 1.
    """
    count_probs = np.exp(process.count_log_probs)
    participate = 1.0 - count_probs[0]
    steps, sample_ids, counts = [], [], []
    position = rng.geometric(participate, samples) - 1
    alive = np.arange(samples)
    while len(alive):
        inside = position < process.steps
        alive, position = alive[inside], position[inside]
        steps.append(position)
        sample_ids.append(alive)
        counts.append(1 + rng.choice(process.max_contributions, size=len(alive),
                                     p=count_probs[1:] / participate) if process.max_contributions > 1
                      else np.ones(len(alive), dtype=np.int64))
        position = position + process.min_sep + rng.geometric(participate, len(alive)) - 1
    return np.concatenate(steps), np.concatenate(sample_ids), np.concatenate(counts)


# Samples per block: the unit of vectorization. Steps are processed backwards in tiles of about
# _TILE_STEPS steps, so every array the kernel touches stays in cache.
_CHUNK = 2048
_BLOCK_SAMPLES = 1024  # samples per block and direction of `sample_log_ratios`
DIRECTIONS = ("P", "Q")
_TILE_STEPS = 64
# A block's weights are exponentiated relative to `shift`, their per-sample maximum clamped below
# at 0, so weights and e^-shift are at most 1 and a block multiplies values by at most b + 1.
# float32 exponentials (4x faster) drop weights below e^-87 relative to e^shift, while the carried
# term s^(b-m) f_next[0] >= s^(2b) times any entry they multiply (f_i >= s f_{i+1}): with shift <= 40
# and 2 b log(1/s) <= 20 a dropped term is below e^-27 = 2e-12 of what is kept. Tiles with larger
# shifts exponentiate in float64; larger b log(1/s) takes the log-space path. Values are rescaled
# every _RESCALE_BLOCKS blocks in float32 tiles (they move by at most (b + 1)^8 up or e^-480 down
# in between), every block otherwise.
_SINGLE_PRECISION_SHIFT = 40.0
_RESCALE_BLOCKS = 8
_LINEAR_SPAN = 10.0


def log_likelihood_ratio(process: MinSepProcess, noise_multiplier: float, outputs: np.ndarray) -> np.ndarray:
    """log P(y)/Q(y) per sample; `outputs` is T x samples (one column per sample)."""
    ratios = []
    for start in range(0, outputs.shape[1], _CHUNK):
        block = outputs[:, start:start + _CHUNK]

        def fill(out: np.ndarray, first: int, block=block) -> None:
            np.divide(block[first:first + len(out)], noise_multiplier, out=out)
        ratios.append(_log_ratios(process, noise_multiplier, block.shape[1], fill))
    return np.concatenate(ratios) if ratios else np.zeros(0)


def _band_matrix(coefficients: np.ndarray, size: int) -> np.ndarray:
    """size x 2 size: the dots <c_i, y_i..y_{i+bands-1}> of the steps of one block of `size` steps are this
    times the outputs of the block and of the next one (bands <= size)."""
    c = np.zeros(2 * size)
    c[:len(coefficients)] = coefficients
    lag = np.arange(2 * size)[None, :] - np.arange(size)[:, None]
    return np.where(lag >= 0, c[np.maximum(lag, 0)], 0.0)


def _log_ratios(process: MinSepProcess, noise_multiplier: float, samples: int, fill) -> np.ndarray:
    """log f_1 for `samples` samples whose outputs over sigma `fill(out, first_step)` writes on demand,
    in blocks of b steps.

    Steps are padded at the front to whole blocks of b = min-sep. Within a block, f_i = s f_{i+1} +
    W_i f_{i+b} unrolls to f_block = A (W * f_next_block) + s^(b-m) f_next_block[0] with A[m, m'] =
    s^(m'-m) (m' >= m, s = Binom(0)): one small matrix product per block. Each block's weights are
    exponentiated relative to their per-sample maximum (float32: the log ratio is exact to ~1e-7
    relative, see _SINGLE_PRECISION_SHIFT) and blocks are rescaled by their maximum, both logs
    accumulated in `log_scale`.
    """
    gap, steps = process.min_sep, process.steps
    blocks = -(-steps // gap)
    lead = blocks * gap - steps
    variance = noise_multiplier ** 2
    coefficients = np.asarray(process.coefficients, dtype=np.float64)
    # <c_i, y_i..>/sigma^2 from y/sigma: block j's dots read its b outputs and the next block's
    dot_bands = _band_matrix(coefficients / noise_multiplier, gap)
    squares = coefficients ** 2  # ||c_i||^2 counts only the bands before the horizon
    half_norms = np.full(blocks * gap, np.inf)
    half_norms[lead:] = np.cumsum(squares)[np.minimum(len(squares), steps - np.arange(steps)) - 1] / (2 * variance)
    log_probs = process.count_log_probs
    stay = float(np.exp(log_probs[0]))
    powers = stay ** np.arange(gap + 1)
    lag = np.arange(gap)[None, :] - np.arange(gap)[:, None]
    unroll = np.where(lag >= 0, powers[lag % gap], 0.0)
    carry = powers[gap - np.arange(gap)][:, None]

    if stay < np.exp(-_LINEAR_SPAN / gap):
        return _recursion_log(process, _direct_log_weight(process, noise_multiplier, fill, samples))
    per_tile = _blocks_per_tile(gap)
    outputs = np.zeros(((per_tile + 1) * gap, samples))  # the tile's outputs, then the next block's
    f = np.ones((gap, samples))
    log_scale = np.zeros(samples)
    for tile_start, tile_end in _tiles(blocks, gap):
        size = tile_end - tile_start
        outputs[size * gap:size * gap + gap] = outputs[:gap]  # the block after this tile
        first_row = tile_start * gap
        real = max(first_row, lead)
        outputs[:real - first_row] = 0.0
        fill(outputs[real - first_row:size * gap], real - lead)
        pairs = as_strided(outputs, shape=(size, 2 * gap, samples), writeable=False,  # a view: rows j b..(j+2) b
                           strides=(gap * outputs.strides[0], *outputs.strides))
        log_weight = _log_weight(np.matmul(dot_bands, pairs), half_norms[first_row:tile_end * gap].reshape(size, gap, 1),
                                 log_probs)
        shift = np.maximum(log_weight.max(axis=1), 0.0)
        single = shift.max() <= _SINGLE_PRECISION_SHIFT
        # log W - shift, rounded to float32 in the same pass where the tile allows it
        weight = np.subtract(log_weight, shift[:, None, :], dtype=np.float32 if single else np.float64,
                             casting="same_kind" if not single else "unsafe")
        np.exp(weight, out=weight)
        carried = np.exp(-shift.astype(np.float32) if single else -shift)
        log_scale += shift.sum(axis=0)
        for block in range(size - 1, -1, -1):
            f_next = f
            f = unroll @ (weight[block] * f_next)
            f += carry * (f_next[0] * carried[block])
            if not single or block % _RESCALE_BLOCKS == 0:
                peak = f.max(axis=0)
                f /= peak
                log_scale += np.log(peak)
    result = np.log(f[lead]) + log_scale
    if not np.isfinite(result).all():  # f_0 >= s^b times its block's peak: cannot happen below _LINEAR_SPAN
        raise FloatingPointError(f"non-finite privacy loss for {process} at sigma {noise_multiplier}")
    return result


def _blocks_per_tile(gap: int) -> int:
    return max(1, _TILE_STEPS // gap)


def _tiles(blocks: int, gap: int):
    """(first block, end block) of each tile, from the last steps backwards."""
    per_tile = _blocks_per_tile(gap)
    for end in range(blocks, 0, -per_tile):
        yield max(0, end - per_tile), end


def _log_weight(dots: np.ndarray, half_norms: np.ndarray, log_probs: np.ndarray) -> np.ndarray:
    """log W_i = log sum_{j>=1} Binom(j) r_i(j) from dots_i / sigma^2 (in place for k_u = 1)."""
    if len(log_probs) == 2:
        dots += log_probs[1] - half_norms
        return dots
    log_weight = np.full_like(dots, -np.inf)
    for count in range(1, len(log_probs)):
        np.logaddexp(log_weight, dots * count + (log_probs[count] - count ** 2 * half_norms), out=log_weight)
    return log_weight


def _direct_log_weight(process: MinSepProcess, noise_multiplier: float, fill, samples: int) -> np.ndarray:
    """log W (T x samples) straight from the definition, for the log-space path; `fill` is asked for the
    same tiles as in `_log_ratios`, so sampled outputs are drawn again identically."""
    gap, steps = process.min_sep, process.steps
    lead = -(-steps // gap) * gap - steps
    outputs = np.zeros((steps + len(process.coefficients), samples))
    for tile_start, tile_end in _tiles(-(-steps // gap), gap):
        first = max(tile_start * gap - lead, 0)
        fill(outputs[first:tile_end * gap - lead], first)
    dots = sum(c * outputs[lag:lag + process.steps] for lag, c in enumerate(process.coefficients))
    squares = np.asarray(process.coefficients) ** 2
    half_norms = np.cumsum(squares)[np.minimum(len(squares), process.steps - np.arange(process.steps)) - 1]
    return _log_weight(dots / noise_multiplier, half_norms[:, None] / (2 * noise_multiplier ** 2),
                       process.count_log_probs)  # outputs are y / sigma


def _recursion_log(process: MinSepProcess, log_weight: np.ndarray) -> np.ndarray:
    """f_i = Binom(0) f_{i+1} + W_i f_{i+b} in log space (T x samples weights)."""
    steps, samples = log_weight.shape
    log_f = np.zeros((steps + process.min_sep, samples))
    stay = process.count_log_probs[0]
    for i in range(steps - 1, -1, -1):
        np.logaddexp(stay + log_f[i + 1], log_weight[i] + log_f[i + process.min_sep], out=log_f[i])
    return log_f[0].copy()


def sample_log_ratios(process: MinSepProcess, noise_multiplier: float, samples: int, seed: int,
                      directions: tuple[str, ...] = DIRECTIONS) -> np.ndarray:
    """log P/Q at `samples` outputs drawn under each of `directions` ("P": y = C x + sigma z, "Q": y = sigma z),
    one row per direction; reproducible from `seed`.

    The directions share the noise z (common random numbers): each row is an independent sample of its own
    distribution, which is all a test of that direction needs. Per block of samples, the participations and
    each tile of z have their own generator keyed by (seed, block, tile), so a tile can be drawn again
    identically, and a direction's row does not depend on which other directions are drawn with it.
    """
    if not directions or not set(directions) <= set(DIRECTIONS):
        raise ValueError(f"directions must be some of {DIRECTIONS}, got {directions!r}")
    _one_blas_thread()
    ratios = []
    bands = np.asarray(process.coefficients)
    firsts = _tile_first_steps(process)
    tile_of_first = {int(first): tile for tile, first in enumerate(firsts)}
    with_p = "P" in directions
    for start in range(0, samples, _BLOCK_SAMPLES):
        size = min(_BLOCK_SAMPLES, samples - start)
        width = size * len(directions)  # columns: one block of samples per direction, P first
        key = [seed, start]
        steps, ids, counts = (sample_participations(process, size, _generator(key, 0)) if with_p
                              else (np.zeros(0, np.int64),) * 3)
        # The entries of C x (a sample's participations are >= b >= bands apart, so their columns of C
        # never overlap and no entry repeats), grouped by tile as flat positions within the tile;
        # participations in step order make the entries nearly sorted by tile, which timsort likes.
        by_step = np.argsort(steps, kind="stable")
        steps, ids, counts = steps[by_step], ids[by_step], counts[by_step]
        rows = (steps[:, None] + np.arange(len(bands))).ravel()
        values = (counts[:, None] * bands).ravel()
        ids = np.repeat(ids, len(bands))
        inside = rows < process.steps
        rows, values, ids = rows[inside], values[inside], ids[inside]
        tiles = np.searchsorted(firsts, rows, side="right") - 1
        order = np.argsort(tiles, kind="stable")
        tiles, values = tiles[order], values[order]
        positions = (rows[order] - firsts[tiles]) * width + ids[order]
        values /= noise_multiplier  # outputs are y / sigma = z + C x / sigma
        bounds = np.searchsorted(tiles, np.arange(len(firsts) + 1))

        def fill(out: np.ndarray, first: int, key=key, size=size, positions=positions, values=values,
                 bounds=bounds) -> None:
            """Outputs over sigma of the tile of steps first.. first + len(out) - 1: z in every direction's
            columns, plus C x / sigma in P's."""
            noise = _generator(key, first + 1).standard_normal((len(out), size))
            for column in range(0, out.shape[1], size):
                out[:, column:column + size] = noise
            tile = tile_of_first[first]
            out.reshape(-1)[positions[bounds[tile]:bounds[tile + 1]]] += values[bounds[tile]:bounds[tile + 1]]
        ratios.append(_log_ratios(process, noise_multiplier, width, fill).reshape(len(directions), size))
    return np.concatenate(ratios, axis=1) if ratios else np.zeros((len(directions), 0))



@functools.cache
def _one_blas_thread() -> None:
    """Limit BLAS to one thread in this process, for good: the kernel's matrix products are small, so
    threads only add synchronization (2 worker processes: ~51,000 P + Q samples/s with OpenBLAS's threads
    limited around each call, ~60,000 with one thread throughout), and callers parallelize over chunks."""
    threadpool_limits(1, user_api="blas")


def _tile_first_steps(process: MinSepProcess) -> np.ndarray:
    """The first step of every tile of `_log_ratios`, ascending."""
    blocks = -(-process.steps // process.min_sep)
    lead = blocks * process.min_sep - process.steps
    return np.array(sorted(max(start * process.min_sep - lead, 0) for start, _ in _tiles(blocks, process.min_sep)))


def _generator(key: list[int], stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([*key, stream])))


def hockey_stick_terms(log_ratios: np.ndarray, epsilon: float, under: str) -> np.ndarray:
    """Per-sample terms whose mean is delta(epsilon) in one direction.

    Under P: delta(P || Q) = E_P[(1 - e^(eps - L))_+]; under Q: delta(Q || P) = E_Q[(1 - e^(eps + L))_+],
    with L = log P/Q.
    """
    exponent = epsilon - log_ratios if under == "P" else epsilon + log_ratios
    return np.clip(-np.expm1(exponent), 0.0, None)


def hockey_stick(log_ratios: np.ndarray, epsilon: float, under: str) -> tuple[float, float]:
    """Estimate and standard error of delta(epsilon) in one direction."""
    terms = hockey_stick_terms(log_ratios, epsilon, under)
    return float(terms.mean()), float(terms.std(ddof=1) / np.sqrt(len(terms)))
