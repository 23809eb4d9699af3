"""The configs of runners/recipes/ (S3, HDFS, a prep-only run): each is a `madp run` config that plans, its
Beam options are all options the installed Beam knows (Beam drops unknown ones silently, which madp refuses),
and the storage options are the ones of Beam's S3 and HDFS file systems."""

from __future__ import annotations

import argparse
import glob
import os

import pytest
import yaml
from apache_beam.options.pipeline_options import HadoopFileSystemOptions, S3Options
from conftest import ROOT

from madp.beam.pipeline import _unknown_beam_args, pipeline_options
from madp.jobs.run_config import RunConfig
from madp.jobs.run_plan import stages_of

pytestmark = [pytest.mark.beam]

RECIPES = sorted(glob.glob(os.path.join(ROOT, "runners", "recipes", "*.yaml")))
PREPARATION = ["bound", "verify-bound", "batch", "verify-batches"]


def _flags(options_class) -> set[str]:
    parser = argparse.ArgumentParser()
    options_class._add_argparse_args(parser)
    return {flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")}


def test_the_recipes_are_there():
    assert [os.path.basename(c) for c in RECIPES] == ["hdfs.yaml", "prep-only.yaml", "s3.yaml"]


@pytest.mark.parametrize("config", RECIPES, ids=os.path.basename)
def test_a_recipe_plans_and_its_runner_options_are_beams(config):
    stages = stages_of(RunConfig.read(config, []))
    assert [stage.name for stage in stages][:4] == PREPARATION
    for name in ("bound", "batch"):
        section = yaml.safe_load(open(config))[name]
        beam_args = ["--runner", section["runner"], *map(str, section["runner_options"])]
        assert _unknown_beam_args(beam_args) == []
        pipeline_options(beam_args)  # madp's own checks of them


def test_the_prep_only_config_stops_before_training():
    (config,) = [c for c in RECIPES if c.endswith("prep-only.yaml")]
    assert [stage.name for stage in stages_of(RunConfig.read(config, []))] == PREPARATION


@pytest.mark.parametrize(
    ("recipe", "options_class", "used"),
    [
        ("s3.yaml", S3Options, {"--s3_region_name", "--s3_endpoint_url"}),
        ("hdfs.yaml", HadoopFileSystemOptions, {"--hdfs_host", "--hdfs_port", "--hdfs_user", "--hdfs_full_urls"}),
    ],
)
def test_the_storage_options_are_those_of_beams_file_system(recipe, options_class, used):
    section = yaml.safe_load(open(os.path.join(ROOT, "runners", "recipes", recipe)))["bound"]
    given = {str(option) for option in section["runner_options"] if str(option).startswith("--")}
    prefix = "--s3_" if options_class is S3Options else "--hdfs_"
    assert {flag for flag in given if flag.startswith(prefix)} == used
    assert used <= _flags(options_class)
