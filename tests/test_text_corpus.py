"""The PyPI corpus builder of benchmarks/text_corpus.py (its figures are in the README): who owns a
package, what its text is, and which packages become records, on hand-written metadata (no network)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = importlib.util.spec_from_file_location("text_corpus", os.path.join(ROOT, "benchmarks", "text_corpus.py"))
text_corpus = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(text_corpus)


def package(name, summary="A tool for parsing logs", topics=("Topic :: System :: Logging",), **fields):
    info = {field: None for field in ("author", "author_email", "maintainer", "maintainer_email")}
    info.update(name=name, summary=summary, classifiers=list(topics), description="", **fields)
    return info


def test_users_are_addresses_else_names():
    both = package("a", author="Ann Lee", author_email="Ann Lee <Ann@X.org>, bo@y.net", maintainer_email="ann@x.org")
    assert text_corpus.pypi_users(both) == ["ann@x.org", "bo@y.net"]
    assert text_corpus.pypi_users(package("b", author="Ann Lee, Bo Wu and Cy Ng")) == ["ann lee", "bo wu", "cy ng"]
    assert text_corpus.pypi_users(package("c", author="Unknown")) == []


def test_description_loses_markup_links_and_addresses():
    description = (
        "[![build](https://img.shields.io/x.svg)](https://ci.org)\n# Logparse\n\n"
        "Parses **logs** with [regexes](https://docs.org/re); mail <a@b.org>.\n.. image:: badge.svg\n"
    )
    assert text_corpus.plain_description(description) == "Logparse Parses logs with regexes; mail ."


def test_records_need_one_topic_an_owner_and_a_new_text():
    infos = [
        package("one", author="Ann"),
        package("two-topics", author="Ann", topics=("Topic :: System :: Logging", "Topic :: Internet")),
        package("no-owner"),
        package("no-words", author="Cy", summary="-"),
        package("copy", author="Bo"),  # the text of "one": left out
        package("other", author="Bo", summary="Plots", topics=("Topic :: Scientific/Engineering :: Visualization",)),
        package("three", author="Cy", summary="Rotates logs"),
        {"name": "gone", "missing": "HTTPError: HTTP Error 404: Not Found"},
    ]
    rows = text_corpus.pypi_records(infos, topics=10)
    assert [(row["id"], row["label"], row["users"]) for row in rows] == [
        ("copy", "System", ["bo"]),  # records are taken in name order: "copy" comes before "one"
        ("other", "Scientific/Engineering", ["bo"]),
        ("three", "System", ["cy"]),
    ]
    assert rows[0]["text"] == "A tool for parsing logs"
    most_common = text_corpus.pypi_records(infos, topics=1)
    assert [row["label"] for row in most_common] == ["System", "System"]
