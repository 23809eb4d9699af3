"""Privacy accounting: mechanisms as small immutable descriptions (`mechanisms`), PLD calibration
(`calibrate`), strategy matrices (`strategies`), and Monte Carlo accounting of BandMF with b-min-sep
sampling with estimate-verify-release (`monte_carlo` over the generators of `random_streams`, `evr`,
its sequential tests in `betting`).

What a user calls is exported here: a mechanism (`DpSgd`, `DpSgdUls`, `BandMf`, `BandMfCyclic`, with
`sampling_probability` and the BandMF bands of `coefficients`, whose error `prefix_sum_mse` gives),
its sigma for a target (`calibrate`, a `Calibration`) or its epsilon at a sigma (`epsilon`,
`composed_epsilon`), and the Monte Carlo accounting of b-min-sep sampling (`MinSepProcess`,
`calibrate_minsep`, `epsilon_minsep`, a `MinSepRelease`).
"""

from madp.accounting.calibrate import Calibration, calibrate, composed_epsilon, epsilon
from madp.accounting.evr import MinSepRelease, calibrate_minsep, epsilon_minsep
from madp.accounting.mechanisms import BandMf, BandMfCyclic, DpSgd, DpSgdUls, sampling_probability
from madp.accounting.monte_carlo import MinSepProcess
from madp.accounting.strategies import coefficients, prefix_sum_mse

__all__ = [
    "BandMf",
    "BandMfCyclic",
    "Calibration",
    "DpSgd",
    "DpSgdUls",
    "MinSepProcess",
    "MinSepRelease",
    "calibrate",
    "calibrate_minsep",
    "coefficients",
    "composed_epsilon",
    "epsilon",
    "epsilon_minsep",
    "prefix_sum_mse",
    "sampling_probability",
]
