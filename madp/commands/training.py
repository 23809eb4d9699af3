"""Training: `madp train`, and the calibrate stage of `madp run` (the privacy plan of its options)."""

from __future__ import annotations

import argparse
import functools

from madp.commands.registry import Family, add_options, options_from
from madp.training.options import TrainOptions


def add_parsers(commands: argparse._SubParsersAction) -> None:
    training = commands.add_parser("train", help="DP-SGD or DP-BandMF training on `madp batch` outputs")
    training.add_argument("batches", help="a `madp batch` output directory")
    training.add_argument("output", help="output directory: model.keras, metrics.json, privacy.json, logs/")
    add_options(training, TrainOptions)


def _train(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.stages.training import run_train

    return run_train(args.batches, args.output, options_from(TrainOptions, args))


def calibrate_batches(args: argparse.Namespace) -> dict:
    """The privacy plan of training on args.batches with args' privacy options, written to args.output: the
    calibrate stage of `madp run`, which parses it as a `madp train` command."""
    from madp.stages.calibrating import calibration_json, run_calibrate

    return calibration_json(run_calibrate(args.batches, args.output, options_from(TrainOptions, args)))


FAMILY = Family(add_parsers, {"train": _train}, {"train": functools.partial(options_from, TrainOptions)})
