"""Training: `madp train`."""

from __future__ import annotations

import argparse

from madp.commands.registry import Family
from madp.core.options import add_options, options_from
from madp.training.options import TrainOptions


def add_parsers(commands: argparse._SubParsersAction) -> None:
    training = commands.add_parser("train", help="DP-SGD or DP-BandMF training on `madp batch` outputs")
    training.add_argument("batches", help="a `madp batch` output directory")
    training.add_argument("output", help="output directory: model.keras, metrics.json, privacy.json, logs/")
    add_options(training, TrainOptions)


def _train(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.stages.training import run_train

    return run_train(args.batches, args.output, options_from(TrainOptions, args)).to_json()


FAMILY = Family(add_parsers, {"train": _train})
