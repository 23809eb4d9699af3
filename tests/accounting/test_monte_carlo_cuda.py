"""The GPU's Monte Carlo samples (`--runner cuda`) against the CPU kernels: the same samples, the same log
ratios up to rounding, and estimates and verifications that stop where the CPU's do. The per-sample
functions the CUDA kernels call run here on the CPU (`monte_carlo_cuda.CPU`); the tests marked `gpu`
run the kernels themselves where cupy and an NVIDIA GPU are present."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from ci_skips import NEEDS_A_GPU

import madp.accounting.mc_delta as mc_delta
from madp.accounting.monte_carlo import MinSepProcess, sample_log_ratios
from madp.accounting.monte_carlo_cuda import CPU, cuda_task_map, draw_log_ratios
from madp.accounting.strategies import sqrt_coefficients
from madp.cli import main

PROCESSES = [
    pytest.param(MinSepProcess(30, 3, 0.2, 1, (1.0, 0.6, 0.3)), 0.8, id="linear-space"),
    pytest.param(MinSepProcess(25, 4, 0.3, 3, (1.0, 0.5)), 0.6, id="three-records"),
    pytest.param(MinSepProcess(20, 2, 0.9, 2, (1.0, 0.4)), 0.15, id="log-space"),
    pytest.param(MinSepProcess(70, 60, 0.05, 1, tuple(sqrt_coefficients(50))), 0.5, id="fft-on-the-cpu-too"),
]
SEEDS = (5, 2**63 + 9)


def on_cpu_kernels(process, sigma, samples, directions, at_least_one):
    """The CPU kernels' log ratios of samples 0..samples - 1 of each of SEEDS, side by side."""
    return np.concatenate(
        [sample_log_ratios(process, sigma, samples, seed, directions, at_least_one) for seed in SEEDS], axis=1
    )


def per_sample_draws(samples):
    return np.repeat(np.array(SEEDS, np.uint64), samples), np.tile(np.arange(samples), len(SEEDS))


@pytest.mark.parametrize("process, sigma", PROCESSES)
@pytest.mark.parametrize("directions, at_least_one", [(("P", "Q"), False), (("P",), True), (("Q",), False)])
def test_the_gpu_functions_draw_the_cpu_kernels_samples(process, sigma, directions, at_least_one):
    seeds, indices = per_sample_draws(40)
    got = draw_log_ratios(process, sigma, seeds, indices, directions, at_least_one, CPU)
    np.testing.assert_allclose(got, on_cpu_kernels(process, sigma, 40, directions, at_least_one), rtol=0, atol=1e-9)


def test_batches_do_not_change_the_samples(monkeypatch):
    process, sigma = MinSepProcess(30, 3, 0.2, 1, (1.0, 0.6, 0.3)), 0.8
    seeds, indices = per_sample_draws(50)
    whole = draw_log_ratios(process, sigma, seeds, indices, device=CPU)
    small = CPU._replace(batch_size=lambda per_sample: 7)
    np.testing.assert_array_equal(draw_log_ratios(process, sigma, seeds, indices, device=small), whole)


@pytest.mark.slow
def test_estimates_and_verifications_stop_where_the_cpus_do():
    """The GPU map draws a wave's chunks together and hands each its own log ratios: the statistics, and so
    every estimate and sequential test, are the CPU's (equal up to the rounding of the log ratios)."""
    process = MinSepProcess(60, 3, 0.1, 2, (1.0, 0.4))
    with mc_delta.task_map(1) as local:
        expected = mc_delta.estimate_delta(process, 0.9, 1.5, 20_000, (4,), local)
        verified = mc_delta.verify(process, 4.0, 1.5, 400_000, (5,), local, 1e-4, 1e-3)
    assert verified[0] and 8192 < verified[1] < 400_000, "the test needs several chunks, and stops before the budget"
    with mc_delta.task_map(1, functools.partial(cuda_task_map, CPU)) as gpu:
        assert gpu.wave > 1
        assert mc_delta.estimate_delta(process, 0.9, 1.5, 20_000, (4,), gpu) == pytest.approx(expected, rel=1e-9)
        assert mc_delta.verify(process, 4.0, 1.5, 400_000, (5,), gpu, 1e-4, 1e-3) == verified


def test_runner_cuda_without_a_gpu_is_a_clear_error(capsys):
    pytest.importorskip("numba.cuda")
    try:
        import cupy  # noqa: F401

        pytest.skip("cupy is installed here")
    except ImportError:
        pass
    base = ["-q", "calibrate", "--epsilon", "2", "--delta", "1e-3", "--steps", "20", "--mechanism", "bandmf-minsep"]
    arguments = [*base, "--sampling-prob", "0.1", "--min-sep", "2", "--bands", "2", "--runner", "cuda"]
    assert main(arguments) == 2
    assert "Monte Carlo on a GPU (--runner cuda, --mc-runner cuda) needs cupy" in capsys.readouterr().err
    assert main([*arguments, "--direct_num_workers", "2"]) == 2
    assert "--runner cuda takes no runner options" in capsys.readouterr().err
    assert main([*arguments, "--workers", "2"]) == 2
    assert "--workers is for --runner local" in capsys.readouterr().err


def gpu_present() -> bool:
    try:
        import cupy
        from numba import cuda

        return cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver: no GPU to test on
        return False


gpu = pytest.mark.skipif(not gpu_present(), reason=f"{NEEDS_A_GPU}: an NVIDIA one, with cupy and numba-cuda")


@gpu
@pytest.mark.parametrize("process, sigma", PROCESSES)
def test_the_gpu_draws_the_cpu_kernels_samples(process, sigma):
    seeds, indices = per_sample_draws(300)
    for directions, at_least_one in ((("P", "Q"), False), (("P",), True)):
        got = draw_log_ratios(process, sigma, seeds, indices, directions, at_least_one)
        want = on_cpu_kernels(process, sigma, 300, directions, at_least_one)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-8)


@gpu
def test_the_gpu_draws_the_cpu_kernels_samples_at_the_production_size():
    process = MinSepProcess(7200, 256, 1.216e-4, 1, tuple(sqrt_coefficients(256)))
    seeds, indices = per_sample_draws(256)
    got = draw_log_ratios(process, 0.36, seeds, indices, ("P", "Q"), False)
    np.testing.assert_allclose(got, on_cpu_kernels(process, 0.36, 256, ("P", "Q"), False), rtol=0, atol=1e-8)


@gpu
def test_the_gpu_map_stops_where_the_cpu_does():
    process = MinSepProcess(60, 3, 0.1, 2, (1.0, 0.4))
    with mc_delta.task_map(1) as local:
        verified = mc_delta.verify(process, 4.0, 1.5, 400_000, (5,), local, 1e-4, 1e-3)
    with mc_delta.task_map(1, cuda_task_map) as gpu_map:
        assert mc_delta.verify(process, 4.0, 1.5, 400_000, (5,), gpu_map, 1e-4, 1e-3) == verified
