"""Privacy accounting: mechanisms as small immutable descriptions (`mechanisms`), PLD calibration
(`calibrate`), strategy matrices (`strategies`), and Monte Carlo accounting of BandMF with b-min-sep
sampling with estimate-verify-release (`monte_carlo` over the generators of `random_streams`, `evr`,
its sequential tests in `betting`)."""
