"""References in plain Python that share no code with madp: the sequential greedy contribution
bounding ("It's my data too", Alg. 2 and 3), which tests compare the engines with and
benchmarks/bound.py times; SipHash-2-4, which tests compare the keyed hashes with; and byte-level
BPE as GPT-2's encoder applies it after the pre-tokenizers' regexes (runs of any length, every pair
scanned for each merge), which tests compare madp's tokenizer with.
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata


def sequential_greedy(
    order: list[int], record_users: list[list], capacity: dict, default: int, duplicates: bool = False
) -> list[int]:
    """Copies per record: one pass in `order` (Alg. 2); with duplicates, passes until one adds nothing (Alg. 3)."""
    used: dict = {}
    copies = [0] * len(record_users)
    while True:
        added = 0
        for r in order:
            users = record_users[r]
            if all(used.get(u, 0) < capacity.get(u, default) for u in users):
                for u in users:
                    used[u] = used.get(u, 0) + 1
                copies[r] += 1
                added += 1
        if not duplicates or added == 0:
            return copies


_MASK = (1 << 64) - 1


def reference_siphash24(key: tuple[int, int], message: bytes) -> int:
    """SipHash-2-4 of a message of any length, written from the paper with Python integers."""
    rotl = lambda x, b: ((x << b) | (x >> (64 - b))) & _MASK  # noqa: E731
    v = [key[0] ^ 0x736F6D6570736575, key[1] ^ 0x646F72616E646F6D, key[0] ^ 0x6C7967656E657261]
    v.append(key[1] ^ 0x7465646279746573)

    def sipround():
        v[0] = (v[0] + v[1]) & _MASK
        v[1] = rotl(v[1], 13) ^ v[0]
        v[0] = rotl(v[0], 32)
        v[2] = (v[2] + v[3]) & _MASK
        v[3] = rotl(v[3], 16) ^ v[2]
        v[0] = (v[0] + v[3]) & _MASK
        v[3] = rotl(v[3], 21) ^ v[0]
        v[2] = (v[2] + v[1]) & _MASK
        v[1] = rotl(v[1], 17) ^ v[2]
        v[2] = rotl(v[2], 32)

    whole = len(message) // 8 * 8
    blocks = [int.from_bytes(message[i : i + 8], "little") for i in range(0, whole, 8)]
    blocks.append(int.from_bytes(message[whole:], "little") | ((len(message) & 0xFF) << 56))
    for block in blocks:
        v[3] ^= block
        sipround()
        sipround()
        v[0] ^= block
    v[2] ^= 0xFF
    for _ in range(4):
        sipround()
    return v[0] ^ v[1] ^ v[2] ^ v[3]


# --- byte-level BPE -------------------------------------------------------------------------------

# Unicode's White_Space property, the \s of the regex engines the tokenizers' regexes are written for
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


@functools.cache
def _category(first_letter: str) -> str:
    """A character class body of every code point whose general category starts with `first_letter`."""
    codes = [c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c))[0] == first_letter]
    spans, start = [], codes[0]
    for previous, code in zip(codes, codes[1:] + [-1]):
        if code != previous + 1:
            spans.append(re.escape(chr(start)) + ("" if previous == start else "-" + re.escape(chr(previous))))
            start = code
    return "".join(spans)


@functools.cache
def _regex(pre_tokenizer: str) -> re.Pattern:
    """The regex of Hugging Face's pre-tokenizer of that name, its letter and number classes spelled out."""
    L, N, s = _category("L"), _category("N"), _WHITE_SPACE  # noqa: N806
    if pre_tokenizer == "llama-bpe":
        return re.compile(
            rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{L}{N}]?[{L}]+|[{N}]{{1,3}}| ?[^{s}{L}{N}]+[\r\n]*|[{s}]*[\r\n]+"
            rf"|[{s}]+(?![^{s}])|[{s}]+"
        )
    return re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{s}{L}{N}]+|[{s}]+(?![^{s}])|[{s}]+")


def reference_pieces(text: str, pre_tokenizer: str) -> list[str]:
    """The pre-tokenized pieces: "smollm" first splits every number character off (Digits), then GPT-2's."""
    if pre_tokenizer != "smollm":
        return _regex(pre_tokenizer).findall(text)
    parts = re.split(f"([{_category('N')}])", text)
    return [piece for i, part in enumerate(parts) for piece in ([part] if i % 2 else _regex("gpt2").findall(part))]


def gpt2_byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the others for 256, 257, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def reference_bpe(word: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """GPT-2's encoder.py `bpe`: the lowest-ranked pair among all adjacent pairs, merged at every place, again."""
    while len(word) > 1:
        best = min(set(zip(word, word[1:])), key=lambda pair: ranks.get(pair, float("inf")))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(word):
            if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                merged.append(word[i] + word[i + 1])
                i += 2
            else:
                merged.append(word[i])
                i += 1
        word = merged
    return word


def reference_bpe_tokens(text: str, merges: list[str], pre_tokenizer: str) -> list[str]:
    """The tokens (as symbol strings) of a text, piece by piece."""
    ranks = {tuple(merge.split(" ", 1)): rank for rank, merge in enumerate(merges)}
    symbols = gpt2_byte_symbols()
    return [
        token
        for piece in reference_pieces(text, pre_tokenizer)
        for token in reference_bpe([symbols[b] for b in piece.encode("utf-8", errors="surrogatepass")], ranks)
    ]
