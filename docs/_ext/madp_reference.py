"""The generated reference pages (docs/reference/, `madp.jobs.reference.pages`) held to madp's declarations.

As a Sphinx extension, on builder-inited: a page that differs from what the declarations render now is a
warning, which fails `make docs` (-W), naming the page and the command that writes it again. The pages stay
checked in, so they read as they are on a forge and in a clone without a build, and links from outside the
site (the README's) reach them. Run as a script, `python docs/_ext/madp_reference.py`, it writes them all.
"""

from __future__ import annotations

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def generated() -> dict[str, str]:
    """Every generated page by its path from the repository's root, as madp's declarations render it now."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from madp.cli import parser
    from madp.jobs.reference import pages

    return pages(parser())


def stale(pages: dict[str, str]) -> list[str]:
    """The paths of the pages whose checked-in text is not `pages`' (missing ones too)."""
    found = []
    for path, text in pages.items():
        written = ROOT / path
        if not written.is_file() or written.read_text(encoding="utf-8") != text:
            found.append(path)
    return found


def _check(app) -> None:
    from sphinx.util import logging

    from madp.jobs.reference import REGENERATE

    for path in stale(generated()):
        logging.getLogger(__name__).warning(f"{path} is stale: run `{REGENERATE}` from the repository's root")


NOTHING = "Nothing"  # a docstring's "Raises: Nothing: why" (every exported name says what it raises)


def _resolve_short_name(app, env, node, contnode):
    """A Python reference by a class's bare name (a docstring's `Returns: BoundReport: ...`), or through a
    module's other name (`rec.Columns`), to the one documented madp object of that name, as a reference
    written `.BoundReport` would find it; a `Raises:` entry "Nothing" stays text."""
    if node.get("refdomain") != "py":
        return None
    if node["reftype"] == "exc" and node["reftarget"].rstrip(".") == NOTHING:
        return contnode
    if node["reftarget"].startswith("madp."):
        return None
    name = node["reftarget"].rpartition(".")[2]  # `rec.Columns`: a madp module imported under another name
    domain = env.get_domain("py")
    named = [each for each in domain.objects if each.startswith("madp.") and each.endswith("." + name)]
    if len(named) != 1:
        return None
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], named[0], node, contnode)


def setup(app) -> dict:
    app.connect("builder-inited", _check)
    app.connect("missing-reference", _resolve_short_name)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    for path, text in generated().items():
        os.makedirs(ROOT / os.path.dirname(path), exist_ok=True)
        (ROOT / path).write_text(text, encoding="utf-8")
