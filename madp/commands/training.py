"""Training: `madp train`, and the calibrate stage of `madp run` (the privacy plan of its options)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

from madp.commands.registry import Family, add_options, options_from
from madp.training.options import TrainOptions


def add_parsers(commands: argparse._SubParsersAction) -> None:
    training = commands.add_parser("train", help="DP-SGD or DP-BandMF training on `madp batch` outputs")
    training.add_argument("batches", help="a `madp batch` output directory")
    training.add_argument("output", help="output directory: model.keras, metrics.json, privacy.json, logs/")
    add_options(training, TrainOptions)


def _train(args: argparse.Namespace, unknown: list[str]) -> dict:
    from madp.training.trainer import train

    return train(args.batches, args.output, options_from(TrainOptions, args))


def calibrate_batches(args: argparse.Namespace) -> dict:
    """The privacy plan of training on args.batches with args' privacy options, written to args.output."""
    from madp.core import storage
    from madp.training.batches import open_batches
    from madp.training.plan import NOT_PRIVATE, epsilon_curve, privacy_plan

    plan = privacy_plan(open_batches(args.batches), options_from(TrainOptions, args))
    stated = (
        {**NOT_PRIVATE, "epsilon_curve": []}  # no plan: no curve either
        if plan is None
        else dataclasses.replace(plan, epsilon_curve=epsilon_curve(plan)).to_json()
    )
    storage.write_text(args.output, json.dumps(stated, indent=2))
    return stated


FAMILY = Family(add_parsers, {"train": _train}, {"train": functools.partial(options_from, TrainOptions)})
