"""The text benchmarks' own parts (their figures are on docs/benchmarks.md, "Text models"): the PyPI corpus
builder of benchmarks/text_corpus.py (who owns a package, what its text is, which packages become
records, on hand-written metadata, no network) and the rows of benchmarks/text_defaults.py's linear
model (the L2-normalized presence vector of the hashed n-grams, as ids and weights)."""

import importlib.util
import json
import os

import numpy as np
import pytest
from conftest import ROOT

from madp.training.text import hashed_ngrams


def benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


text_corpus = benchmark("text_corpus")


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


def test_linear_rows_are_the_normalized_presence_vector(tmp_path):
    texts = ["spam spam spam eggs", "eggs and ham", "a b c d e f g h i j k l m n o p"]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": label}) + "\n" for t, label in zip(texts, "yxy")))
    buckets, max_length = 64, 16  # few buckets: collisions, which presence counts once
    ids, weights, labels = benchmark("text_defaults").presence_rows(str(path), ["x", "y"], buckets, max_length, 2, 0)
    rows = np.zeros((len(texts), buckets))
    np.add.at(rows, (np.arange(len(texts))[:, None], ids), weights)
    expected = np.zeros((len(texts), buckets))
    hashed = hashed_ngrams(np.array([t.encode() for t in texts], dtype=object), buckets, max_length, 2, prefix=0)
    for row, text_ids in enumerate(hashed):
        present = sorted(set(text_ids.tolist()) - {0})
        expected[row, present] = 1 / np.sqrt(len(present))
    np.testing.assert_allclose(rows, expected, rtol=1e-6)  # padding (id 0) weighs nothing
    assert labels.tolist() == [1, 0, 1]


def test_a_second_corpus_leaves_out_the_firsts_packages_and_texts():
    first = [{"id": "a", "text": "Parses logs"}, {"id": "b", "text": "Plots data"}]
    second = [
        {"id": "a", "text": "another text"},  # the same package
        {"id": "c", "text": "parses LOGS"},  # the same text, another package
        {"id": "d", "text": "Sends mail"},
    ]
    assert text_corpus.disjoint(second, first) == [{"id": "d", "text": "Sends mail"}]


def test_a_cache_line_cut_short_is_fetched_again_and_a_broken_one_is_named(tmp_path, monkeypatch, capsys):
    """A run stopped as it wrote the cache leaves a last line without its newline: the next run leaves
    it out, fetches that package again and writes it on a line of its own; a broken line elsewhere
    stops the run naming the file and line, not with a traceback."""
    cache = tmp_path / "cache.jsonl"
    kept = {"name": "kept", "summary": "a"}
    cache.write_text(json.dumps(kept) + "\n" + json.dumps({"name": "cut", "summary": "b"})[:15], encoding="utf-8")
    fetched = {"name": "cut", "summary": "fetched"}
    monkeypatch.setattr(text_corpus, "pypi_info", lambda name: {"name": name, "summary": "fetched"})
    assert text_corpus.fetch_pypi(["kept", "cut"], str(cache), threads=1) == [kept, fetched]
    assert "line 2 is cut short" in capsys.readouterr().err
    assert [json.loads(line)["name"] for line in cache.read_text().splitlines()] == ["kept", "cut"]
    assert text_corpus.cached_pypi(str(cache)) == {"kept": kept, "cut": fetched}
    cache.write_text("{broken\n" + json.dumps(kept) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"cache.jsonl: line 1 is not a package entry"):
        text_corpus.cached_pypi(str(cache))
