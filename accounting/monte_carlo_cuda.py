"""The Monte Carlo samples of `madp.accounting.monte_carlo` on one NVIDIA GPU (`madp calibrate --runner cuda`).

A thread per sample draws exactly what the CPU kernels draw: its noise from stream (seed, sample, 0) and
its participations from (seed, sample, 1), with the same compiled generator (numba compiles the CPU
kernels' `@njit` functions again for the GPU), so a chunk's samples are the CPU's, and its log ratios
agree with theirs up to rounding (the FFT's, and CUDA's exp): a sequential test stops where it would on
the CPU. The dots are cuFFT's (cupy); the recursion runs one chain per thread in linear space with
rescaling where `monte_carlo` says that is exact, else in log space, as on the CPU.

Needs numba-cuda and cupy with a CUDA GPU: `pip install 'madp[cuda]'`. The per-sample functions are
`@njit` functions that the CUDA kernels call for their thread's sample; `CPU` runs them in a loop with
numpy's FFT, which is how the tests check them on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
from numba import njit, uint64

try:
    from numba import cuda
except ImportError:  # a numba without its CUDA target, and no numba-cuda: gpu() says so
    cuda = None  # type: ignore[assignment]

from madp.accounting.mc_delta import RemoteMap, given_one
from madp.accounting.monte_carlo import (
    _CHECK_STEPS,
    _NOISE,
    _PARTICIPATIONS,
    _RESCALE_ABOVE,
    DIRECTIONS,
    MinSepProcess,
    _add_participation,
    _dots_plan,
    _Kernel,
    _kernel,
    _linear_holds,
    _log_f_log_space,
    _participations,
)
from madp.accounting.random_streams import fill_standard_normals, seed_stream
from madp.core.errors import InputError

_THREADS = 128  # threads per block
_MEMORY_SHARE = 0.4  # of the GPU's free memory, for one batch's arrays
_KERNEL_ARRAYS = ("coefficients", "overlaps", "weight_table", "log_weight_table", "count_cdf")


@njit(cache=True)
def _fill_noise(seeds, indices, steps, noise, n, state):
    """Row n of noise: the `steps` standard normals of sample indices[n] of seed seeds[n] (the columns past
    stay 0); `state` is the thread's generator."""
    seed_stream(state, seeds[n], indices[n], _NOISE)
    fill_standard_normals(noise[n, :steps], state)


@njit(inline="always", cache=True)
def _weight(d, kernel, i):
    """W_i = sum_j Binom(j) e^(j d_i - j^2 h_i) by Horner's rule in e^(d_i) (d_i <= _LINEAR_EXPONENT / k_u), as
    `monte_carlo._weights` (with math.exp, CUDA's on the GPU, where the CPU kernels' series is within 1e-14)."""
    table = kernel.weight_table
    exponential = math.exp(d)
    weight = table[table.shape[0] - 1, i]
    for count in range(table.shape[0] - 2, -1, -1):
        weight = weight * exponential + table[count, i]
    return weight * exponential


@njit(cache=True)
def _log_f(d, kernel, f):
    """log f_0 of the recursion of `monte_carlo` on dots d ([T]), one chain, in f ([T + b]): in linear space,
    rescaled every _CHECK_STEPS steps where f left its range, when `monte_carlo._linear_holds` says that is
    exact; else in log space (`monte_carlo._log_f_log_space`)."""
    steps, gap = d.shape[0], kernel.min_sep
    if _linear_holds(d, kernel):
        for j in range(steps, steps + gap):
            f[j] = 1.0
        log_scale = 0.0
        i = steps - 1
        while i >= 0:
            stop = max(i - _CHECK_STEPS, -1)
            for j in range(i, stop, -1):
                f[j] = kernel.stay * f[j + 1] + _weight(d[j], kernel, j) * f[j + gap]
            i = stop
            current = f[i + 1]
            if not 1.0 / _RESCALE_ABOVE <= current <= _RESCALE_ABOVE:
                for j in range(i + 1, i + 1 + gap):  # the f that later steps read
                    f[j] /= current
                log_scale += math.log(current)
        return math.log(f[0]) + log_scale
    return _log_f_log_space(d, kernel, f)


@njit(cache=True)
def _sample_log_ratios(space, kernel, with_p, with_q, at_least_one, out, n, state):
    """out[:, n] = [log P/Q under P, under Q] of sample n from its Q dots space.q_dots[:, n] (a column per
    sample, so that a warp's reads of one step are adjacent); under P plus its participations'."""
    steps = space.q_dots.shape[0]
    if with_p:
        seed_stream(state, space.seeds[n], space.indices[n], _PARTICIPATIONS)
        for i in range(steps):
            space.p_dots[i, n] = space.q_dots[i, n]
        taken = _participations(state, kernel, steps, at_least_one, space.starts[:, n], space.counts[:, n])
        for m in range(taken):
            _add_participation(space.starts[m, n], space.counts[m, n], kernel, space.p_dots[:, n])
        out[0, n] = _log_f(space.p_dots[:, n], kernel, space.f[:, n])
    if with_q:
        out[1, n] = _log_f(space.q_dots[:, n], kernel, space.f[:, n])


class _Batch(NamedTuple):
    """A batch's arrays, on the GPU (cupy) or on the CPU (numpy)."""

    seeds: Any  # [N] uint64
    indices: Any  # [N] int64
    q_dots: Any  # [T, N]
    p_dots: Any  # [T, N]
    starts: Any  # [T // b + 1, N] int64: a sample's participations
    counts: Any  # [T // b + 1, N] int64
    f: Any  # [T + b, N]


def _fill_noise_kernel(seeds, indices, steps, noise):
    n = cuda.grid(1)
    if n < seeds.shape[0]:
        _fill_noise(seeds, indices, steps, noise, n, cuda.local.array(4, uint64))


def _log_ratios_kernel(
    seeds, indices, q_dots, p_dots, starts, counts, f, coefficients, overlaps, weight_table, log_weight_table,
    count_cdf, inv_sigma, min_sep, stay, log_stay, linear, with_p, with_q, at_least_one, out,
):  # fmt: skip
    """`_sample_log_ratios` for thread n; the batch and the kernel come as their arrays and numbers."""
    n = cuda.grid(1)
    if n < seeds.shape[0]:
        space = _Batch(seeds, indices, q_dots, p_dots, starts, counts, f)
        kernel = _Kernel(
            coefficients, overlaps, inv_sigma, min_sep, stay, log_stay,
            weight_table, log_weight_table, count_cdf, linear,
        )  # fmt: skip
        _sample_log_ratios(space, kernel, with_p, with_q, at_least_one, out, n, cuda.local.array(4, uint64))


@njit(cache=True)
def _fill_noise_cpu(seeds, indices, steps, noise):
    state = np.empty(4, np.uint64)
    for n in range(seeds.shape[0]):
        _fill_noise(seeds, indices, steps, noise, n, state)


@njit(cache=True)
def _log_ratios_cpu(space, kernel, with_p, with_q, at_least_one, out):
    state = np.empty(4, np.uint64)
    for n in range(space.seeds.shape[0]):
        _sample_log_ratios(space, kernel, with_p, with_q, at_least_one, out, n, state)


class _Device(NamedTuple):
    """Where a batch runs: the GPU (cupy arrays, the CUDA kernels), or, for the tests, the same per-sample
    functions in a loop on the CPU (numpy)."""

    xp: Any
    fill_noise: Callable
    log_ratios: Callable
    batch_size: Callable[[int], int]  # samples of a batch, from the bytes one sample takes
    release: Callable[[], None]  # gives back what a call held (the GPU's memory pool and FFT plans)


def gpu() -> _Device:
    """The GPU, or an InputError saying what is missing (cupy, numba-cuda, a GPU)."""
    needs = "Monte Carlo on a GPU (--runner cuda, --mc-runner cuda) needs"
    try:
        import cupy
    except ImportError as error:
        raise InputError(f"{needs} cupy and numba-cuda ({error}): pip install 'madp[cuda]'") from None
    if cuda is None:
        raise InputError(f"{needs} numba-cuda (this numba has no CUDA target): pip install 'madp[cuda]'")
    try:
        usable = cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError as error:  # e.g. a driver older than cupy's CUDA
        raise InputError(f"{needs} an NVIDIA GPU that cupy can use: {error}") from None
    if not usable:
        raise InputError(f"{needs} an NVIDIA GPU that numba-cuda and cupy can use; none was found")
    fill_kernel, ratios_kernel = _compiled_kernels()

    def fill_noise(seeds, indices, steps, noise):
        fill_kernel[_blocks(len(seeds)), _THREADS](seeds, indices, steps, noise)

    def log_ratios(space, kernel, with_p, with_q, at_least_one, out):
        k = kernel
        ratios_kernel[_blocks(len(space.seeds)), _THREADS](
            *space, k.coefficients, k.overlaps, k.weight_table, k.log_weight_table, k.count_cdf, k.inv_sigma,
            k.min_sep, k.stay, k.log_stay, k.linear, with_p, with_q, at_least_one, out,
        )  # fmt: skip

    def batch_size(per_sample: int) -> int:
        free, _ = cupy.cuda.runtime.memGetInfo()
        return max(_THREADS, int(_MEMORY_SHARE * free) // per_sample // _THREADS * _THREADS)

    def release() -> None:
        cupy.fft.config.clear_plan_cache()
        cupy.get_default_memory_pool().free_all_blocks()

    return _Device(cupy, fill_noise, log_ratios, batch_size, release)


@functools.cache
def _compiled_kernels() -> tuple:
    """The CUDA kernels (numba-cuda compiles each at its first launch)."""
    return cuda.jit(_fill_noise_kernel), cuda.jit(_log_ratios_kernel)


def _blocks(samples: int) -> int:
    return -(-samples // _THREADS)


# The GPU's per-sample functions in a loop on the CPU, batches of 1024: how the tests check them without a GPU.
CPU = _Device(np, _fill_noise_cpu, _log_ratios_cpu, lambda per_sample: 1024, lambda: None)


def draw_log_ratios(
    process: MinSepProcess,
    noise_multiplier: float,
    seeds: np.ndarray,
    indices: np.ndarray,
    directions: tuple[str, ...] = DIRECTIONS,
    at_least_one: bool = False,
    device: _Device | None = None,
) -> np.ndarray:
    """log P/Q of sample indices[n] of seed seeds[n], for every n, one row per direction: what
    `monte_carlo.sample_log_ratios(process, noise_multiplier, ..., seeds[n], directions, at_least_one)` gives
    for that sample, up to rounding, computed on the GPU (`device` None) in batches that fit its memory."""
    if not directions or not set(directions) <= set(DIRECTIONS):
        raise ValueError(f"directions must be some of {DIRECTIONS}, got {directions!r}")
    device = device or gpu()
    xp = device.xp
    seeds = np.asarray(seeds, np.uint64)  # chunk seeds: 64 bits (`monte_carlo.sample_log_ratios`)
    indices = np.asarray(indices, np.int64)
    kernel = _kernel(process, noise_multiplier)
    plan = _dots_plan(kernel, process.steps, True)
    steps, width, gap = process.steps, plan.width, process.min_sep
    on_device = kernel._replace(**{name: xp.asarray(getattr(kernel, name)) for name in _KERNEL_ARRAYS})
    spectrum = xp.asarray(plan.spectrum)
    with_p, with_q = "P" in directions, "Q" in directions
    most = steps // gap + 1  # participations of one sample at most
    # A sample's arrays: its noise, spectrum, their product and dots (and cuFFT's work areas for the two
    # transforms, as large again), the transposed dots, P's, f and the participations.
    largest = device.batch_size(8 * (6 * width + 3 * steps + gap + 2 * most))
    batches = -(-len(seeds) // largest)
    rows = -(-len(seeds) // batches)  # every batch of one size (one pair of FFT plans): the last one padded
    padding = batches * rows - len(seeds)  # < batches samples, drawn again and dropped
    seeds, indices = np.append(seeds, seeds[-1:].repeat(padding)), np.append(indices, indices[-1:].repeat(padding))
    ratios = np.full((2, len(seeds)), np.nan)
    try:  # what the GPU held goes back even when a batch fails (the noise when the frame goes)
        noise = xp.zeros((rows, width))
        for first in range(0, len(seeds), rows):
            space = _Batch(
                xp.asarray(seeds[first : first + rows]),
                xp.asarray(indices[first : first + rows]),
                None,
                xp.empty((steps, rows)) if with_p else xp.empty((0, rows)),
                xp.empty((most, rows), np.int64),
                xp.empty((most, rows), np.int64),
                xp.empty((steps + gap, rows)),
            )
            device.fill_noise(space.seeds, space.indices, steps, noise)
            dots = xp.fft.irfft(xp.fft.rfft(noise, axis=1) * spectrum, width, axis=1)
            space = space._replace(q_dots=xp.ascontiguousarray(dots[:, :steps].T))
            del dots
            out = xp.full((2, rows), np.nan)
            device.log_ratios(space, on_device, with_p, with_q, at_least_one, out)
            ratios[:, first : first + rows] = out if xp is np else out.get()
            del space, out
        del noise
    finally:
        device.release()
    ratios = ratios[[DIRECTIONS.index(under) for under in directions], : len(seeds) - padding]
    if not np.isfinite(ratios).all():
        raise FloatingPointError(f"non-finite privacy loss for {process} at sigma {noise_multiplier}")
    return ratios


def gpu_task_map() -> RemoteMap:
    """`cuda_task_map` on the GPU, which is looked for now: an InputError before any work where none is."""
    return functools.partial(cuda_task_map, gpu())


@contextlib.contextmanager
def cuda_task_map(device: _Device | None = None):
    """A `map(fn, tasks)` over Monte Carlo chunk tasks (`madp.accounting.mc_delta.RemoteMap`) whose samples the
    GPU draws, all of a call's chunks in the same batches; `fn` (`mc_delta.chunk_statistics`) then turns
    each chunk's log ratios into its statistics here. The samples are the CPU's, so an estimate or a
    verification stops where it would on the CPU. `device`: the GPU (None), or `CPU` for the tests."""
    device = device or gpu()

    def map_chunks(fn: Callable, tasks: Iterable) -> list:
        tasks = list(tasks)
        drawn: dict[tuple, list[int]] = {}  # the tasks drawn together: same process, sigma and draw
        for n, task in enumerate(tasks):
            drawn.setdefault((task.process, task.sigma, task.directions, given_one(task)), []).append(n)
        ratios: list = [None] * len(tasks)
        for (process, sigma, directions, at_least_one), members in drawn.items():
            sizes = [tasks[n].size for n in members]
            seeds = np.repeat(np.array([tasks[n].seed for n in members], np.uint64), sizes)
            indices = np.concatenate([np.arange(size) for size in sizes])
            rows = draw_log_ratios(process, sigma, seeds, indices, directions, at_least_one, device)
            for n, part in zip(members, np.split(rows, np.cumsum(sizes)[:-1], axis=1)):
                ratios[n] = part
        return [fn(task, part) for task, part in zip(tasks, ratios)]

    yield map_chunks
