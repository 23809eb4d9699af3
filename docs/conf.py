"""Sphinx configuration of madp's documentation site (`make docs` builds it into build/docs/)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

project = "madp"
author = "madp contributors"
# madp_reference: the generated reference pages (docs/reference/) checked against madp's declarations
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "madp_reference"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_ext"]
# Every reference must resolve: a link to a missing page, heading or Python name fails the build (-W -n).
nitpicky = True
# The site builds offline, so no intersphinx: a type of the standard library or of a dependency that a
# signature names stays plain text. A name of madp's own must resolve (madp_reference resolves a short one).
nitpick_ignore_regex = [
    ("py:.*", r"(collections\.abc|contextlib|numpy|np|pyarrow|apache_beam|beam|pyspark|tensorflow|tf|tf_keras)\..*"),
    ("py:class", r"DataFrame"),
    ("py:class", r"record_reading\.Content"),  # a type alias (a union of the content's forms), no class
]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]
html_theme = "furo"
html_title = "madp"
autodoc_typehints = "description"
