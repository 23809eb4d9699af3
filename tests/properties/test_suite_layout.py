"""The suite's layout (conftest.SUITES): every test file lies in one of its folders, and no two share a name,
since test modules are imported, and import each other's helpers, by their file's name."""

from __future__ import annotations

import collections
import glob
import os

from conftest import SUITES, TESTS


def test_every_test_file_is_in_a_suite_folder_under_a_name_of_its_own():
    files = glob.glob(os.path.join(TESTS, "**", "test_*.py"), recursive=True)
    outside = sorted(
        os.path.relpath(f, TESTS) for f in files if os.path.relpath(f, TESTS).split(os.sep)[0] not in SUITES
    )
    assert not outside, f"test files outside the suite folders {SUITES}: {outside}"
    names = collections.Counter(os.path.basename(f) for f in files)
    assert not [name for name, count in names.items() if count > 1], names.most_common(3)
