"""A real multi-owner text corpus available offline: CPython's changelog, from the Debian package
`python3.11-doc` (the PSF documentation licence), as madp records.

Each changelog item is a record: `text` is the item (its issue number left out), `label` the
section it is filed under (Library, Core and Builtins, Tests, IDLE, Build, Documentation, C API,
Windows, Security, Tools/Demos, macOS: 11 classes, about 10,000 items of Python 3.5 to 3.11), and
`users` the people the item credits ("Patch by A and B.", "Contributed by C.", ...). About a
quarter of the items credit someone; an item that credits nobody is its own single owner
(`item:<id>`), which the README states wherever a figure comes from this corpus.

    python benchmarks/text_corpus.py OUT.jsonl [--deb python3.11-doc_*.deb]

Without --deb the package is fetched with `apt-get download` (Debian's mirror, no other network).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import html
import json
import os
import re
import subprocess
import tempfile

CHANGELOG = "./usr/share/doc/python3.11/html/whatsnew/changelog.html.gz"
_TOKENS = re.compile(r"<h2>(.*?)<a|<h3>(.*?)<a|<li><p>(.*?)</p>\s*</li>", re.S)
_CREDIT = re.compile(
    r"(?:[Pp]atch(?:es)?|[Cc]ontributed|[Ii]mplemented|[Ww]ritten|[Oo]riginal patch|[Ii]nitial patch)\s+by\s+([^.;(]+)"
)
_ISSUE = re.compile(r"^\s*(?:gh|bpo)-\d+:\s*")


def _plain(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def credited(text: str) -> list[str]:
    """The names an item credits, in order of appearance, each once."""
    names: list[str] = []
    for group in _CREDIT.findall(text):
        for name in re.split(r",\s*|\s+and\s+|\s*&\s*", group):
            name = name.strip()
            if name and len(name) < 40 and name not in names:
                names.append(name)
    return names


def records(changelog_html: str) -> list[dict]:
    """The changelog's items as records (id, users, text, label, version)."""
    version = section = ""
    out: list[dict] = []
    for match in _TOKENS.finditer(changelog_html):
        if match.group(1) is not None:
            version = _plain(match.group(1))
        elif match.group(2) is not None:
            section = _plain(match.group(2))
        else:
            item = _plain(match.group(3))
            text = _ISSUE.sub("", item)
            if not text or not section:
                continue
            record_id = len(out)
            out.append(
                {
                    "id": record_id,
                    "users": credited(text) or [f"item:{record_id}"],
                    "text": text,
                    "label": section,
                    "version": version,
                }
            )
    return out


def changelog_from_deb(deb: str) -> str:
    with tempfile.TemporaryDirectory() as directory:
        subprocess.run(["dpkg-deb", "-x", deb, directory], check=True)
        with gzip.open(os.path.join(directory, CHANGELOG), "rt", encoding="utf-8") as file:
            return file.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--deb", help="a python3.11-doc .deb (default: apt-get download it)")
    args = parser.parse_args()
    deb = args.deb
    if deb is None:
        directory = tempfile.mkdtemp()
        subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=directory, check=True)
        (deb,) = glob.glob(os.path.join(directory, "python3.11-doc_*.deb"))
    items = records(changelog_from_deb(deb))
    with open(args.output, "w", encoding="utf-8") as file:
        for item in items:
            file.write(json.dumps(item) + "\n")
    credited_items = sum(not item["users"][0].startswith("item:") for item in items)
    print(json.dumps({"records": len(items), "crediting someone": credited_items, "output": args.output}))


if __name__ == "__main__":
    main()
