"""Byte-level BPE tokenization as GPT-2's, Llama 3's and SmolLM's (what a pretrained model's file
gives as its tokenizer): `BpeTokenizer` pre-tokenizes a text into pieces by its model's regex, writes
each piece's UTF-8 bytes as printable symbols (`byte_symbols`) and merges them by rank into token
ids; `token_sequences` turns texts into a causal LM's inputs and targets; `check_vocabulary` is the
check each reader of a tokenizer makes, that any text tokenizes to ids of its vocabulary."""

from __future__ import annotations

import functools
import heapq
import re
import sys
import unicodedata
from collections.abc import Callable, Container, Iterator, Sequence

import numpy as np

from madp.core.errors import InputError

# Pre-tokenizers implemented here, by llama.cpp's names (tokenizer.ggml.pre): GPT-2's byte-level
# regex; SmolLM's, which first splits every digit off on its own (Hugging Face's
# Digits(individual_digits=True)); Llama 3's ("llama-bpe"), which keras-hub's BytePairTokenizer also
# applies on its Python path.
PRE_TOKENIZERS = ("gpt2", "smollm", "llama-bpe")


@functools.cache
def byte_symbols() -> tuple[str, ...]:
    """GPT-2's printable stand-in for each byte value: the printable Latin-1 bytes are themselves, the
    others (controls, space, ...) are the code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte], extra = chr(256 + extra), extra + 1
    return tuple(symbols[byte] for byte in range(256))


@functools.cache
def text_bytes() -> frozenset[int]:
    """The bytes that text can hold: those of the UTF-8 of every assigned character but the controls,
    and of the controls that are Unicode whitespace (tab, newline, ...). A vocabulary may lack the others (the other
    C0 controls, the bytes UTF-8 never uses, the lead bytes of unassigned planes), as SmolLM2's does:
    its tokenizer, as Hugging Face's and llama.cpp's, drops them from a text."""
    found: set[int] = set()
    whitespace = re.compile(f"[{WHITESPACE}]")
    for code in range(sys.maxunicode + 1):
        character = chr(code)
        category = unicodedata.category(character)
        if category != "Cn" and (category != "Cc" or whitespace.match(character)):
            found.update(character.encode("utf-8", errors="surrogatepass"))
    return frozenset(found)


@functools.cache
def _character_class(prefix: str) -> str:
    """A regex character class body of every code point whose Unicode category starts with `prefix`
    (L: letters, N: numbers): what \\p{L} and \\p{N} of the tokenizer's regex match; Python's re has
    no \\p{...}."""
    ranges: list[list[int]] = []
    for code in range(sys.maxunicode + 1):
        if unicodedata.category(chr(code)).startswith(prefix):
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1][1] = code
            else:
                ranges.append([code, code])
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


# Unicode's White_Space: what \s means in the tokenizers' regex engines (Python's \s adds U+001C-U+001F)
WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# The longest run of letters, numbers, other symbols, whitespace or trailing newlines that one piece takes
# (the tokenizers' regexes take runs of any length): a longer run is pre-tokenized in runs of this many
# characters. Ordinary text has no such run, so its tokens are the tokenizers' own; capped, a piece
# holds at most 2 x RUN + 1 characters (symbols then newlines), matching it reads at most one
# character more, and its merges work on at most 4 x (2 x RUN + 1) bytes.
RUN = 256
PIECE_READ = 2 * RUN + 2  # characters that matching one piece reads at most
UTF8_WIDTH = 4  # bytes of a character, at most


@functools.cache
def _pieces_pattern(pre_tokenizer: str) -> re.Pattern:
    """The pre-tokenization regex of `pre_tokenizer`, every run at most RUN characters.

    GPT-2's ("gpt2"): English contractions, a word of letters or a run of numbers or of other symbols,
    each with its leading space, and runs of whitespace (all but the last space before a word).
    SmolLM's ("smollm"): GPT-2's between number characters, each of which is a piece of its own (as
    splitting them off first would: no run takes a number character, and a number character ends a
    run of whitespace as the end of the text does). Llama 3's ("llama-bpe"): contractions in any case,
    a word of letters behind at most one other character (not a newline), numbers in runs of at most
    three digits, other symbols with their leading space and trailing newlines, and runs of whitespace
    as GPT-2's."""
    letters, numbers, ws = _character_class("L"), _character_class("N"), WHITESPACE
    run, some = f"{{1,{RUN}}}", f"{{0,{RUN}}}"
    if pre_tokenizer == "llama-bpe":
        return re.compile(
            rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{letters}{numbers}]?[{letters}]{run}|[{numbers}]{{1,3}}"
            rf"| ?[^{ws}{letters}{numbers}]{run}[\r\n]{some}|[{ws}]{some}[\r\n]{run}|[{ws}]{run}(?![^{ws}])"
            rf"|[{ws}]{run}"
        )
    contractions, words, symbols = "'s|'t|'re|'ve|'m|'ll|'d", f" ?[{letters}]{run}", f" ?[^{ws}{letters}{numbers}]{run}"
    if pre_tokenizer == "smollm":
        return re.compile(rf"[{numbers}]|{contractions}|{words}|{symbols}|[{ws}]{run}(?![^{ws}{numbers}])|[{ws}]{run}")
    return re.compile(rf"{contractions}|{words}| ?[{numbers}]{run}|{symbols}|[{ws}]{run}(?![^{ws}])|[{ws}]{run}")


def _text_prefix(text: str | bytes, characters: int) -> str:
    """The first `characters` characters of a text (UTF-8 bytes decoded, what is not UTF-8 as U+FFFD),
    reading at most UTF8_WIDTH x characters + 3 bytes of it: a character takes at most UTF8_WIDTH
    bytes, and a character the cut splits (at most 3 bytes) lies past the characters kept."""
    if isinstance(text, str):
        return text[:characters]
    return bytes(text[: UTF8_WIDTH * characters + 3]).decode("utf-8", errors="replace")[:characters]


class BpeTokenizer:
    """Byte-level BPE as GPT-2's: text -> pre-tokenized pieces -> UTF-8 bytes as printable symbols ->
    the merges applied by rank within each piece -> token ids. Special (control) tokens are not
    parsed out of text: "<|endoftext|>" in a text is tokenized as ordinary characters."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        bos: int,
        eos: int,
        pad: int,
        pre_tokenizer: str,
        control: frozenset[int] = frozenset(),
    ):
        self.tokens = list(tokens)
        self.ids = {token: i for i, token in enumerate(self.tokens)}
        self.ranks = {tuple(merge.split(" ", 1)): rank for rank, merge in enumerate(merges)}
        if pre_tokenizer not in PRE_TOKENIZERS:
            raise ValueError(f"pre-tokenizer {pre_tokenizer!r}, not one of {PRE_TOKENIZERS}")
        self.bos, self.eos, self.pad, self.pre_tokenizer, self.control = bos, eos, pad, pre_tokenizer, control
        self.byte_of = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
        # the bytes without a symbol in the vocabulary (`check_vocabulary` allows only bytes text never holds)
        self._dropped = bytes(byte for byte, symbol in enumerate(byte_symbols()) if symbol not in self.ids)
        self._cache: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def pieces(self, text: str) -> Iterator[str]:
        """The pre-tokenized pieces of a text, in order, each found as it is asked for (what is not asked
        for is not read); they concatenate to the text."""
        return (match.group() for match in _pieces_pattern(self.pre_tokenizer).finditer(text))

    def encode(self, text: str | bytes, limit: int | None = None) -> list[int]:
        """Token ids of a text (a str, or UTF-8 bytes: what is not UTF-8 is U+FFFD; no BOS); with `limit`,
        the first `limit` of them, reading only the text's first `limit` x PIECE_READ characters.

        Why that bound holds: pieces are tokenized apart and each gives at least one token, so the first
        `limit` tokens come from the first `limit` pieces at most. The pieces tile the text and each holds
        fewer than PIECE_READ characters, so the i-th starts within the first (i - 1) x (PIECE_READ - 1),
        and matching it reads at most PIECE_READ characters from its start: the first `limit` pieces, and
        their tokens, are the same in the text and in that prefix."""
        if limit is not None:
            text = _text_prefix(text, limit * PIECE_READ)
        elif not isinstance(text, str):
            text = bytes(text).decode("utf-8", errors="replace")
        ids: list[int] = []
        for piece in self.pieces(text):
            if limit is not None and len(ids) >= limit:
                break
            ids.extend(self._piece_ids(piece))
        return ids if limit is None else ids[:limit]

    def decode(self, ids: Sequence[int] | np.ndarray, skip_control: bool = True) -> str:
        """The text of token ids (bytes that are not whole UTF-8 characters become U+FFFD)."""
        data = bytearray()
        for i in np.asarray(ids, dtype=np.int64).tolist():
            if skip_control and i in self.control:
                continue
            token = self.tokens[i]
            for symbol in token:
                byte = self.byte_of.get(symbol)
                data.extend(symbol.encode("utf-8") if byte is None else bytes((byte,)))
        return data.decode("utf-8", errors="replace")

    def _piece_ids(self, piece: str) -> tuple[int, ...]:
        found = self._cache.get(piece)
        if found is None:
            symbols = byte_symbols()
            data = piece.encode("utf-8", errors="surrogatepass")  # a lone surrogate: its bytes, as any byte
            data = data.translate(None, self._dropped)
            found = tuple(self.ids[part] for part in self._merged([symbols[b] for b in data]))
            if len(self._cache) < 1 << 20:  # bounded: a corpus of distinct pieces must not exhaust memory
                self._cache[piece] = found
        return found

    def _merged(self, parts: list[str]) -> list[str]:
        """The merges applied to a piece's symbols: repeatedly, the lowest-ranked adjacent pair, at
        every place it occurs, left to right (GPT-2's rule). The pairs wait in a heap by rank, so n
        symbols take O(n log n) steps rather than a scan of every pair for each merge (O(n^2)).

        symbols[i] is the symbol that starts at the piece's i-th byte symbol ("" once merged into the
        one before it); after[i] and before[i] link the symbols still there. A heap entry (rank, i) is
        the pair starting at i when it was pushed; it is stale once that pair changed (its rank then
        differs: a rank names one pair)."""
        symbols = list(parts)
        count = len(symbols)
        after, before = list(range(1, count + 1)), list(range(-1, count - 1))

        def rank_at(i: int) -> int | None:
            return self.ranks.get((symbols[i], symbols[after[i]])) if 0 <= i and after[i] < count else None

        waiting = [(rank, i) for i in range(count - 1) if (rank := rank_at(i)) is not None]
        heapq.heapify(waiting)
        while waiting:
            rank = waiting[0][0]
            places = []
            while waiting and waiting[0][0] == rank:
                places.append(heapq.heappop(waiting)[1])
            for i in sorted(places):  # every place of the pair, left to right
                if not symbols[i] or rank_at(i) != rank:
                    continue  # merged into the symbol before it, or the pair changed
                absorbed = after[i]
                symbols[i] += symbols[absorbed]
                symbols[absorbed] = ""
                after[i] = after[absorbed]
                if after[i] < count:
                    before[after[i]] = i
                for start in (before[i], i):  # the two pairs the merged symbol now starts or ends
                    if (formed := rank_at(start)) is not None:
                        heapq.heappush(waiting, (formed, start))
        return [symbol for symbol in symbols if symbol]


def token_sequences(tokenizer: BpeTokenizer, texts, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), int32 [n, max_length]: each text's first max_length tokens as targets (-1
    past its end), behind BOS as inputs (padding past the end: attention is causal, so it changes
    no earlier position)."""
    n = len(texts)
    targets = np.full((n, max_length), -1, dtype=np.int32)
    for row, value in enumerate(texts):
        ids = tokenizer.encode(value, limit=max_length)  # reads only the prefix those tokens can come from
        targets[row, : len(ids)] = ids
    inputs = np.concatenate(
        [np.full((n, 1), tokenizer.bos, np.int32), np.where(targets[:, :-1] >= 0, targets[:, :-1], tokenizer.pad)],
        axis=1,
    )
    return inputs, targets.astype(np.int32)


def check_vocabulary(
    vocabulary: Container[str], merges: Sequence[str], bad: Callable[[str], InputError], tokens: str, merge: str
) -> None:
    """That a byte-level BPE vocabulary holds the symbol of every byte that text holds (`text_bytes`; the
    tokenizer drops the others), and every merge is two of its tokens whose merge it holds too: else a
    text would tokenize to a symbol that has no id. `tokens` and `merge` name where the vocabulary and
    a merge come from, for the error."""
    symbols = byte_symbols()
    missing = [symbols[byte] for byte in sorted(text_bytes()) if symbols[byte] not in vocabulary]
    if missing:
        raise bad(f"{tokens} lacks the symbols of {len(missing)} bytes (e.g. {missing[0]!r})")
    for number, pair in enumerate(merges, 1):
        parts = pair.split(" ")
        if len(parts) != 2 or not all(symbol and symbol in vocabulary for symbol in (*parts, "".join(parts))):
            raise bad(f"{merge} {number} ({pair!r}) is not two tokens of the vocabulary whose merge is in it too")
