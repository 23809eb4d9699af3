"""Sampling keys that no input can steer (issue 25, section 3): SipHash-2-4 keyed over each whole id,
checked against the reference test vectors; two string ids (or users) chosen to share an unkeyed
FNV-1a hash, as an attacker who controls an id can choose them, still get independent sampled steps
through `madp batch`, on both engines."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pyarrow as pa
import pytest
from conftest import write_records
from reference import reference_siphash24

from madp.cli import main
from madp.core.hashing import hash_ids, id_words, siphash24, siphash24_bytes
from madp.core.randomness import SecretKey
from madp.core.verify import _example_class, _feature_values, read_tfrecord
from madp.engines.batching import record_hashes, user_hashes

MASK = (1 << 64) - 1
REFERENCE_KEY = (0x0706050403020100, 0x0F0E0D0C0B0A0908)  # the bytes 00..0f
# SipHash-2-4 of the messages 00..(n-1), n = 0..63, under REFERENCE_KEY: the reference
# implementation's vectors.h (vectors_sip64), each 8 output bytes read as a little-endian uint64.
REFERENCE_VECTORS = [
    0x726FDB47DD0E0E31, 0x74F839C593DC67FD, 0x0D6C8009D9A94F5A, 0x85676696D7FB7E2D,
    0xCF2794E0277187B7, 0x18765564CD99A68D, 0xCBC9466E58FEE3CE, 0xAB0200F58B01D137,
    0x93F5F5799A932462, 0x9E0082DF0BA9E4B0, 0x7A5DBBC594DDB9F3, 0xF4B32F46226BADA7,
    0x751E8FBC860EE5FB, 0x14EA5627C0843D90, 0xF723CA908E7AF2EE, 0xA129CA6149BE45E5,
    0x3F2ACC7F57C29BDB, 0x699AE9F52CBE4794, 0x4BC1B3F0968DD39C, 0xBB6DC91DA77961BD,
    0xBED65CF21AA2EE98, 0xD0F2CBB02E3B67C7, 0x93536795E3A33E88, 0xA80C038CCD5CCEC8,
    0xB8AD50C6F649AF94, 0xBCE192DE8A85B8EA, 0x17D835B85BBB15F3, 0x2F2E6163076BCFAD,
    0xDE4DAAACA71DC9A5, 0xA6A2506687956571, 0xAD87A3535C49EF28, 0x32D892FAD841C342,
    0x7127512F72F27CCE, 0xA7F32346F95978E3, 0x12E0B01ABB051238, 0x15E034D40FA197AE,
    0x314DFFBE0815A3B4, 0x027990F029623981, 0xCADCD4E59EF40C4D, 0x9ABFD8766A33735C,
    0x0E3EA96B5304A7D0, 0xAD0C42D6FC585992, 0x187306C89BC215A9, 0xD4A60ABCF3792B95,
    0xF935451DE4F21DF2, 0xA9538F0419755787, 0xDB9ACDDFF56CA510, 0xD06C98CD5C0975EB,
    0xE612A3CB9ECBA951, 0xC766E62CFCADAF96, 0xEE64435A9752FE72, 0xA192D576B245165A,
    0x0A8787BF8ECB74B2, 0x81B3E73D20B49B6F, 0x7FA8220BA3B2ECEA, 0x245731C13CA42499,
    0xB78DBFAF3A8D83BD, 0xEA1AD565322A1A0B, 0x60E61C23A3795013, 0x6606D7E446282B93,
    0x6CA4ECB15C5F91E1, 0x9F626DA15C9625F3, 0xE51B38608EF25F57, 0x958A324CEB064572,
]  # fmt: skip

# Two Message-IDs with equal FNV-1a-64 hashes (0x2e850b2ed7243880). Found by a lattice trick: after a
# shared prefix, byte i changes the state difference D by D <- (D + d_i) * P mod 2^64, where d_i, the
# difference of the two xors' effects, can be steered to any small value given the state's low byte;
# so D ends at sum_i d_i P^(15-i) mod 2^64 and LLL finds small d_i (|d_i| <= 13) with that sum 0; the
# bytes realizing them are then chosen position by position among letters and digits.
COLLIDING = ("<apfaAbAhaaa0aa@example.org>", "<c1Y52ZwZelZhgd@example.org>")
BEAM = ["--runner", "DirectRunner", "--direct_running_mode", "in_memory", "--partitions", "2"]


def fnv1a64(data: bytes) -> int:
    """FNV-1a 64 (Fowler, Noll, Vo), written from its definition."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & MASK
    return h


# --- the keyed PRF ---------------------------------------------------------------------------------


def test_siphash_of_bytes_matches_the_reference_vectors():
    messages = [bytes(range(n)) for n in range(64)]
    assert [reference_siphash24(REFERENCE_KEY, m) for m in messages] == REFERENCE_VECTORS
    assert siphash24_bytes(REFERENCE_KEY, pa.array(messages, pa.binary())).tolist() == REFERENCE_VECTORS
    # Published values: the empty message, and 00..0e (15 bytes: a whole block and a partial one).
    assert REFERENCE_VECTORS[0] == 0x726FDB47DD0E0E31 and REFERENCE_VECTORS[15] == 0xA129CA6149BE45E5
    # The 8-byte word form used for integer ids is the same function of the word's little-endian bytes.
    word = int.from_bytes(bytes(range(8)), "little")
    assert int(siphash24(REFERENCE_KEY, np.array([word], np.uint64))[0]) == REFERENCE_VECTORS[8]


def test_siphash_of_bytes_agrees_with_the_word_form_and_the_reference_on_random_messages():
    rng = np.random.default_rng(5)
    key = (int(rng.integers(0, 2**63)) * 2 + 1, int(rng.integers(0, 2**63)))
    words = rng.integers(0, 2**63, 200, dtype=np.int64).view(np.uint64) * np.uint64(3)
    as_bytes = pa.array([int(w).to_bytes(8, "little") for w in words], pa.binary())
    assert np.array_equal(siphash24_bytes(key, as_bytes), siphash24(key, words))
    messages = [rng.bytes(int(n)) for n in rng.integers(0, 40, 300)] + [rng.bytes(5000), rng.bytes(4097)]
    expected = [reference_siphash24(key, m) for m in messages]
    assert siphash24_bytes(key, pa.array(messages, pa.large_binary())).tolist() == expected
    # A slice (Arrow offsets not starting at 0), chunks and numpy strings hash each value's own bytes.
    assert siphash24_bytes(key, pa.array(messages, pa.binary()).slice(7, 50)).tolist() == expected[7:57]
    texts = ["", "é", "naïve café ☕", "x" * 17, "<a@b>"]
    chunked = pa.chunked_array([pa.array(texts[:2]), pa.array(texts[2:])])
    utf8 = [reference_siphash24(key, t.encode()) for t in texts]
    assert siphash24_bytes(key, chunked).tolist() == utf8
    assert siphash24_bytes(key, np.array(texts)).tolist() == utf8
    assert siphash24_bytes(key, pa.array(texts, pa.large_string())).tolist() == utf8


def test_a_megabyte_id_hashes_in_milliseconds_and_every_byte_counts():
    big = "m" * 1_000_000
    ids = pa.array([big, big[:-1] + "n", "n" + big[1:], big + "m"])
    key = SecretKey.from_seed(1, "test").subkey(7)
    siphash24_bytes(key, ids[:1])  # compiled (or loaded from numba's cache) before timing
    hash_ids(ids[:1], 0)
    started = time.perf_counter()
    keyed = siphash24_bytes(key, ids)
    keyed_seconds = time.perf_counter() - started
    started = time.perf_counter()
    public = hash_ids(ids, 0)
    public_seconds = time.perf_counter() - started
    assert len(set(keyed.tolist())) == 4 and len(set(public.tolist())) == 4, "the first and last bytes count"
    assert keyed[0] == reference_siphash24(key, big.encode())
    assert keyed_seconds < 0.5 and public_seconds < 0.5, (keyed_seconds, public_seconds)  # about 4 MB: ~4 ms


# --- ids an attacker chose ---------------------------------------------------------------------------


def test_the_pair_collides_under_fnv1a_but_not_under_the_keyed_hashes():
    a, b = (c.encode() for c in COLLIDING)
    assert a != b and fnv1a64(a) == fnv1a64(b) == 0x2E850B2ED7243880
    ids = pa.array(COLLIDING)
    assert id_words(ids)[0] == id_words(ids)[1], "the public pre-hash is unkeyed FNV-1a: it collides"
    key = SecretKey.from_seed(2, "test")
    for hashes in (record_hashes(ids, key), user_hashes(ids, key)):
        assert hashes[0] != hashes[1]
    assert record_hashes(ids, key).tolist() != record_hashes(ids, SecretKey.from_seed(3, "test")).tolist()


def test_integer_and_string_ids_never_share_a_keyed_hash():
    """An integer id hashes its 8-byte word; the string of those 8 bytes hashes under another subkey."""
    key = SecretKey.from_seed(4, "test")
    text = "01234567"
    word = pa.array([int.from_bytes(text.encode(), "little")], pa.int64())
    assert record_hashes(word, key)[0] != record_hashes(pa.array([text]), key)[0]
    assert user_hashes(word, key)[0] != user_hashes(pa.array([text]), key)[0]
    # Integer users keep a public bijection of their id: two distinct users never share one.
    users = pa.array(np.arange(-500, 500), pa.int64())
    assert len(np.unique(user_hashes(users, key))) == 1000
    assert np.array_equal(user_hashes(users, key), user_hashes(users, SecretKey.from_seed(5, "test")))


# --- through the command line --------------------------------------------------------------------------


def rows_by_id(output) -> dict:
    """{id: (sorted steps, user feature values)} of the rows of a batch output (no padding here)."""
    example = _example_class()
    found: dict[object, tuple[list[int], set[int]]] = {}
    for name in sorted(os.listdir(output)):
        if name.endswith(".tfrecord"):
            for payload in read_tfrecord(os.path.join(output, name)):
                row = example.FromString(payload)
                key = _feature_values(row, "id")[0]
                key = key.decode() if isinstance(key, bytes) else key
                steps, users = found.setdefault(key, ([], set()))
                steps.append(_feature_values(row, "step")[0])
                users.update(_feature_values(row, "user") if "user" in row.features.feature else [])
    return {key: (sorted(steps), users) for key, (steps, users) in found.items()}


def bounded(tmp_path, capsys, rows, *options) -> tuple[str, str]:
    data = write_records(str(tmp_path / "records.jsonl"), rows)
    assert main(["-q", "bound", data, str(tmp_path / "bounded"), "-k", "1", "--runner", "local", *options]) == 0
    capsys.readouterr()
    return str(tmp_path / "bounded"), data


def batch(capsys, selected, data, output, *args) -> dict:
    code = main(["-q", "batch", selected, data, str(output), "--steps", "100", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def colliding_records() -> list[dict]:
    """The colliding ids as two records of their own users, among 30 others."""
    ids = [*COLLIDING, *(f"<filler-{i}@example.org>" for i in range(30))]
    return [{"id": record, "users": [user], "x": [1.0]} for user, record in enumerate(ids)]


def test_string_ids_with_one_fnv_hash_get_independent_steps(tmp_path, capsys):
    """Equal sampling keys would give them identical steps; independent ones agree on all of 100
    steps (each sampled with p of about 0.31) with probability 0.57^100 < 1e-24."""
    selected, data = bounded(tmp_path, capsys, colliding_records())
    batch(capsys, selected, data, tmp_path / "out", "--batch-size", "10", "--runner", "local")
    rows = rows_by_id(tmp_path / "out")
    first, second = (rows[record][0] for record in COLLIDING)
    assert first and second and first != second


@pytest.mark.beam
def test_string_ids_with_one_fnv_hash_get_independent_steps_on_beam_as_locally(tmp_path, capsys):
    selected, data = bounded(tmp_path, capsys, colliding_records())
    for engine, args in (("local", ["--runner", "local"]), ("beam", BEAM)):
        batch(capsys, selected, data, tmp_path / engine, "--batch-size", "5", "--min-sep", "2", "--seed", "3", *args)
    rows = rows_by_id(tmp_path / "beam")
    first, second = (rows[record][0] for record in COLLIDING)
    assert first and second and first != second
    # Colliding keys also broke the engines' agreement: Beam's |N(e)| count takes records by key.
    files = [
        sorted(f for f in os.listdir(tmp_path / engine) if f.endswith(".tfrecord")) for engine in ("local", "beam")
    ]
    assert files[0] == files[1]
    for name in files[0]:
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "beam" / name).read_bytes()


def test_string_users_with_one_fnv_hash_are_sampled_and_clipped_as_two(tmp_path, capsys):
    """--sampler users (run by the driver on every engine): the two users must draw their steps
    independently and carry different `user` features, or per-user clipping would clip them as one."""
    users = [*COLLIDING, *(f"<user-{i}@example.org>" for i in range(30))]
    rows = [{"id": record, "users": [user], "x": [1.0]} for record, user in enumerate(users)]
    selected, data = bounded(tmp_path, capsys, rows, "--user-ids", "as-is")  # hash collisions, not people's addresses
    report = batch(capsys, selected, data, tmp_path / "out", "--sampler", "users", "--batch-size", "10")
    found = rows_by_id(tmp_path / "out")
    (first, first_user), (second, second_user) = found[0], found[1]
    assert first and second and first != second
    assert len(first_user) == len(second_user) == 1 and first_user != second_user
    assert report["participation"]["users"] == 32
