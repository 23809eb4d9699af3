"""Sphinx configuration of madp's documentation site (`make docs` builds it into build/docs/)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

project = "madp"
author = "madp contributors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
# Every reference must resolve: a link to a missing page, heading or Python name fails the build (-W -n).
nitpicky = True
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]
html_theme = "furo"
html_title = "madp"
autodoc_typehints = "description"
