"""What a runner's workers install is the whole package under its madp. import names: Dataflow stages
`--setup_file ./setup.py` as an sdist, which carries no links, so the wheel built from it must hold
madp.accounting, madp.beam and madp.training from the repo's top-level folders."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_the_wheel_built_from_the_sdist_holds_every_package(tmp_path):
    subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT, check=True, capture_output=True
    )
    (sdist,) = glob.glob(str(tmp_path / "madp-*.tar.gz"))
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert not [n for n in names if "/madp/accounting" in n or "/madp/beam" in n or "/madp/training" in n], (
        "the links are not packed; the mapping installs the folders"
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", sdist, "-w", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    (wheel,) = glob.glob(str(tmp_path / "madp-*.whl"))
    packed = set(zipfile.ZipFile(wheel).namelist())
    for folder, package in (("accounting", "accounting"), ("beam_pipelines", "beam"), ("tf_training", "training")):
        modules = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, folder, "*.py"))}
        assert {f"madp/{package}/{m}" for m in modules} <= packed, folder
    assert "madp/core/record_reading.py" in packed and "madp/cli.py" in packed
