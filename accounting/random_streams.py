"""Compiled random streams for the Monte Carlo kernels: one xoshiro256++ generator per (seed, sample,
stream), seeded through SplitMix64, and standard normals by the 256-layer ziggurat (Marsaglia and
Tsang, "The ziggurat method for generating random variables", 2000).

Keying every sample's streams by its number makes a sample's draws independent of which other samples
or directions a call draws, and of how samples are split over workers. None of this randomness is
secret: it only estimates a privacy loss distribution, and its seed is printed with the estimate.

numba caches the compiled kernels beside this file (`cache=True`), keyed by its path and time stamp
and holding the module's import name (`madp.accounting.random_streams`); a cache written under an
earlier name is stale, so this note changed with the name, which made numba compile afresh.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, uint64

_LAYERS = 256
_TAIL_START = 3.6541528853610088  # r of the 256-layer ziggurat: every layer (the base with its tail) has one area


def _ziggurat_edges() -> np.ndarray:
    """x_0 > x_1 = r > ... > x_255 > x_256 = 0: layer i covers [0, x_i] between heights f(x_i) and f(x_(i+1)),
    f(x) = exp(-x^2 / 2), each of area v; x_0 = v / f(r) is the width that the base layer, tail included,
    would have as a rectangle."""

    def density(x: float) -> float:
        return math.exp(-0.5 * x * x)

    area = _TAIL_START * density(_TAIL_START) + math.sqrt(math.pi / 2) * math.erfc(_TAIL_START / math.sqrt(2))
    edges = np.zeros(_LAYERS + 1)
    edges[0], edges[1] = area / density(_TAIL_START), _TAIL_START
    for i in range(1, _LAYERS - 1):
        edges[i + 1] = math.sqrt(-2.0 * math.log(area / edges[i] + density(edges[i])))
    return edges


EDGES = _ziggurat_edges()
HEIGHTS = np.exp(-0.5 * EDGES**2)
_GOLDEN = 0x9E3779B97F4A7C15


@njit(inline="always", cache=True)
def _rotate(x, bits):
    return (x << uint64(bits)) | (x >> uint64(64 - bits))


@njit(inline="always", cache=True)
def _mix(z):
    """SplitMix64's finalizer."""
    z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
    return z ^ (z >> uint64(31))


@njit(cache=True)
def seed_stream(state, seed, sample, stream):
    """Seed xoshiro256++ `state` (4 uint64) for (seed, sample, stream) with SplitMix64 outputs."""
    z = _mix(_mix(uint64(seed) + uint64(_GOLDEN)) ^ (uint64(sample) * uint64(4) + uint64(stream)))
    for word in range(4):
        z += uint64(_GOLDEN)
        state[word] = _mix(z)


@njit(inline="always", cache=True)
def _step(s0, s1, s2, s3):
    """xoshiro256++ (Blackman and Vigna): 64 random bits and the next state."""
    result = _rotate(s0 + s3, 23) + s0
    shifted = s1 << uint64(17)
    s2 ^= s0
    s3 ^= s1
    s1 ^= s2
    s0 ^= s3
    s2 ^= shifted
    return result, s0, s1, s2, _rotate(s3, 45)


@njit(inline="always", cache=True)
def next_bits(state):
    result, state[0], state[1], state[2], state[3] = _step(state[0], state[1], state[2], state[3])
    return result


@njit(inline="always", cache=True)
def uniform(state):
    """Uniform on [0, 1) with 53 random bits."""
    return float(next_bits(state) >> uint64(11)) * (1.0 / 9007199254740992.0)


@njit(inline="always", cache=True)
def failures_before_success(state, log_failure, cap):
    """Geometric: failures before the first success when each fails with probability e^log_failure,
    capped at `cap` (by inversion: floor(log U / log(1 - p)), U in (0, 1])."""
    if log_failure == 0.0:
        return cap
    return int(min(math.log(1.0 - uniform(state)) / log_failure, float(cap)))


@njit(inline="always", cache=True)
def failures_before_success_below(state, log_failure, cap):
    """The same geometric conditioned on being below `cap` (a success within `cap` trials), by inversion of
    its truncated law: floor(log(1 - U (1 - (1 - p)^cap)) / log(1 - p)), U in [0, 1)."""
    below = -math.expm1(cap * log_failure)  # Pr[success within cap trials]
    return int(min(math.log1p(-uniform(state) * below) / log_failure, float(cap - 1)))


@njit(cache=True)
def _outside_rectangle(state, layer, value):
    """The rare ziggurat case: a tail draw (base layer) or the accept test of a wedge; NaN to start over."""
    if layer == 0:
        while True:  # Marsaglia's tail method: x = r + E1 / r, accepted when 2 E2 > (E1 / r)^2
            excess = -math.log(1.0 - uniform(state)) / EDGES[1]
            if -2.0 * math.log(1.0 - uniform(state)) > excess * excess:
                return EDGES[1] + excess
    height = HEIGHTS[layer] + uniform(state) * (HEIGHTS[layer + 1] - HEIGHTS[layer])
    return value if height < math.exp(-0.5 * value * value) else math.nan


@njit(cache=True)
def fill_standard_normals(out, state):
    """Fill `out` with standard normals. One 64-bit draw gives the layer (8 bits), the sign (1) and the
    position across the layer (52); it is accepted at once when inside the layer's rectangle (~99%).
    The state is held in locals, which halves the cost of a draw."""
    s0, s1, s2, s3 = state[0], state[1], state[2], state[3]
    filled = 0
    while filled < out.shape[0]:
        bits, s0, s1, s2, s3 = _step(s0, s1, s2, s3)
        layer = int(bits & uint64(0xFF))
        value = float(bits >> uint64(12)) * (1.0 / 4503599627370496.0) * EDGES[layer]
        if value >= EDGES[layer + 1]:
            state[0], state[1], state[2], state[3] = s0, s1, s2, s3
            value = _outside_rectangle(state, layer, value)
            s0, s1, s2, s3 = state[0], state[1], state[2], state[3]
            if math.isnan(value):
                continue
        out[filled] = value * (1.0 - 2.0 * float((bits >> uint64(8)) & uint64(1)))  # a branch here: 1.7x slower
        filled += 1
    state[0], state[1], state[2], state[3] = s0, s1, s2, s3


@njit(cache=True)
def _normals(seed, sample, stream, count):
    state = np.empty(4, np.uint64)
    seed_stream(state, seed, sample, stream)
    out = np.empty(count)
    fill_standard_normals(out, state)
    return out


@njit(cache=True)
def _uniforms(seed, sample, stream, count):
    state = np.empty(4, np.uint64)
    seed_stream(state, seed, sample, stream)
    out = np.empty(count)
    for i in range(count):
        out[i] = uniform(state)
    return out


def check_seed(seed: int) -> np.uint64:
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"a Monte Carlo seed must be in [0, 2^64), got {seed}")
    return np.uint64(seed)


def standard_normals(seed: int, sample: int, stream: int, count: int) -> np.ndarray:
    """The first `count` normals of stream (seed, sample, stream)."""
    return _normals(check_seed(seed), sample, stream, count)


def uniforms(seed: int, sample: int, stream: int, count: int) -> np.ndarray:
    """The first `count` uniforms of stream (seed, sample, stream)."""
    return _uniforms(check_seed(seed), sample, stream, count)
