"""A Llama-architecture model in a GGUF file (llama.cpp's format), read without llama.cpp:
`read_gguf` checks its header's layout (`_check_gguf_layout`) before the gguf package reads it, then
its metadata's types and sizes against the tensors it stores, and gives its configuration, its
byte-level BPE tokenizer (the vocabulary and merges of its `tokenizer.ggml.*` metadata) and, read when
loaded, its weights: each tensor dequantized to float32 with the `gguf` package (`_gguf_weights`).

GGUF facts this relies on: a 2-D tensor of GGUF shape [n_in, n_out] is stored row-major as a numpy
array [n_out, n_in] (PyTorch's Linear layout; a Keras kernel is its transpose), and llama.cpp's
converter permutes the rows of the query and key projections of each head so that its RoPE rotates
adjacent pairs (2i, 2i+1); Hugging Face's Llama rotates the two halves (i, i + d/2). `_unpermute`
undoes the converter's permutation, so the Keras model rotates halves like the original checkpoint.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import re
import struct
from typing import Any, Literal

import numpy as np

from madp.core.errors import InputError, OptionError, check_memory, memory_limit
from madp.training.bpe_tokenizer import PRE_TOKENIZERS, BpeTokenizer, check_vocabulary
from madp.training.pretrained_files import (
    LlamaConfig,
    Pretrained,
    check_model_memory,
    check_sizes,
    finite_weights,
)

ARCHITECTURE = "llama"
GGUF_MAGIC = b"GGUF"
CONTROL_TOKEN = 3  # tokenizer.ggml.token_type of special tokens (<|endoftext|>, <|im_start|>, ...)


def read_gguf(path: str) -> Pretrained:
    """The configuration and tokenizer of a Llama-architecture model in a GGUF file (InputError if it
    is missing, unreadable, or holds another architecture or tokenizer); its weights are read by
    `layer_weights()`. The metadata is checked before any model is built: each value's type, the
    sizes against the tensors the file stores, the tokenizer's ids and symbols against its
    vocabulary, and the model's size against memory."""
    reader = _open_gguf(path)
    fields = _Fields(path, reader)
    architecture = fields.text("general.architecture")
    if architecture != ARCHITECTURE:
        raise OptionError(
            "{pretrained} {0}: a {1!r} model; madp implements the {2!r} architecture only",
            path,
            architecture,
            ARCHITECTURE,
        )
    tokens = fields.texts("tokenizer.ggml.tokens")
    width, heads = fields.whole("llama.embedding_length"), fields.whole("llama.attention.head_count")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = LlamaConfig(
        vocabulary=fields.whole("llama.vocab_size", len(tokens)),
        layers=fields.whole("llama.block_count"),
        width=width,
        hidden=fields.whole("llama.feed_forward_length"),
        heads=heads,
        kv_heads=fields.whole("llama.attention.head_count_kv", heads),
        head_dim=fields.whole("llama.rope.dimension_count", width // heads),
        rope_base=fields.number("llama.rope.freq_base", 10000.0),
        norm_epsilon=fields.number("llama.attention.layer_norm_rms_epsilon"),
        context_length=fields.whole("llama.context_length"),
        tied_output="output.weight" not in tensors,
    )
    check_sizes(path, config)
    if len(tokens) != config.vocabulary:
        raise OptionError(
            "{pretrained} {0}: llama.vocab_size is {1}, but tokenizer.ggml.tokens lists {2} tokens",
            path,
            config.vocabulary,
            len(tokens),
        )
    _check_gguf_tensors(path, config, tensors)
    check_model_memory(path, config)
    return Pretrained(
        path, config, _tokenizer(path, fields, tokens), functools.partial(_gguf_weights, path, tensors, config)
    )


def _gguf_tensor_shapes(config: LlamaConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors a GGUF file of the architecture holds, by name: their shape in numpy's order
    ([n_out, n_in], GGUF's dimensions reversed) and the metadata that gives it."""
    c = config
    vocabulary, width = (c.vocabulary, "llama.vocab_size"), (c.width, "llama.embedding_length")
    hidden = (c.hidden, "llama.feed_forward_length")
    queries = (c.heads * c.head_dim, "llama.attention.head_count x the head size")
    keys = (c.kv_heads * c.head_dim, "llama.attention.head_count_kv x the head size")

    def shape(*dimensions: tuple[int, str]) -> tuple[tuple[int, ...], str]:
        return tuple(n for n, _ in dimensions), " x ".join(f"{key} ({n})" for n, key in dimensions)

    shapes = {"token_embd.weight": shape(vocabulary, width), "output_norm.weight": shape(width)}
    if not c.tied_output:
        shapes["output.weight"] = shape(vocabulary, width)
    for i in range(c.layers):
        block = {
            "attn_norm": shape(width),
            "ffn_norm": shape(width),
            "attn_q": shape(queries, width),
            "attn_k": shape(keys, width),
            "attn_v": shape(keys, width),
            "attn_output": shape(width, queries),
            "ffn_gate": shape(hidden, width),
            "ffn_up": shape(hidden, width),
            "ffn_down": shape(width, hidden),
        }
        shapes.update({f"blk.{i}.{name}.weight": found for name, found in block.items()})
    return shapes


_BLOCK_TENSOR = re.compile(r"blk\.([0-9]+)\.")


def _check_gguf_tensors(path: str, config: LlamaConfig, tensors: dict[str, Any]) -> None:
    """The metadata's sizes against the tensors the file stores, before a model of those sizes is built:
    the blocks (blk.N.*) are blocks 0 to llama.block_count - 1, and each tensor of the architecture is
    there with the shape the metadata gives it."""
    blocks = sorted({int(found.group(1)) for name in tensors if (found := _BLOCK_TENSOR.match(name))})
    if len(blocks) != config.layers or blocks[-1] != config.layers - 1:  # distinct: blocks 0 to block_count - 1
        held = f"blocks {blocks[:5]}{' ...' if len(blocks) > 5 else ''}" if blocks else "no block"
        raise OptionError(
            "{pretrained} {0}: llama.block_count is {1}, but the file holds the tensors of {2} blocks ({3})",
            path,
            config.layers,
            len(blocks),
            held,
        )
    for name, (shape, given_by) in _gguf_tensor_shapes(config).items():
        found = tensors.get(name)
        if found is None:
            raise OptionError("{pretrained} {0}: no tensor {1!r} (a {2} model has one)", path, name, ARCHITECTURE)
        stored = tuple(int(n) for n in reversed(found.shape.tolist()))
        if stored != shape:
            raise OptionError(
                "{pretrained} {0}: tensor {1!r} has shape {2}, where the metadata gives {3}: {4}",
                path,
                name,
                stored,
                shape,
                given_by,
            )


def check_gguf_file(path: str) -> None:
    """That `path` is a file that starts as a GGUF file does (reading its first 4 bytes only)."""
    if not os.path.isfile(path):
        raise OptionError("{pretrained} {0}: no such file (a local .gguf file; `make pretrained` fetches one)", path)
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise OptionError(
            "{pretrained} {0}: not a GGUF file (it starts with {1!r}, not {2!r})", path, magic, GGUF_MAGIC
        )


def _open_gguf(path: str):
    check_gguf_file(path)
    _check_gguf_layout(path)
    try:
        import gguf
    except ImportError as error:
        raise InputError("reading a GGUF file needs the gguf package: pip install -e '.[train]'") from error
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, EOFError) as error:  # truncated or corrupt
        raise OptionError(
            "{pretrained} {0}: unreadable GGUF file ({1}: {2})", path, type(error).__name__, str(error)
        ) from None


# GGUF's layout, as the gguf package reads it: value types by number (GGUFValueType), the bytes of
# each fixed-size one; versions 2 and 3 (64-bit counts and lengths).
_GGUF_FIXED_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_VERSIONS = (2, 3)
# The fewest bytes of a metadata entry (its key's length, its type, a 1-byte value) and of a tensor's
# info (its name's length, no dimension, its type and offset).
_GGUF_LEAST_ENTRY, _GGUF_LEAST_TENSOR = 13, 24
# gguf.GGUFReader holds a numpy view of the file for each part of the metadata: a key's length, name
# and type; a string's length and bytes; a number; an array's type and count, then each element's parts;
# and 7 per tensor. Each holds 0.7 to 1.2 KB (measured: numpy 2.4, gguf 0.19), and takes about 10 us.
_READER_BYTES_PER_PART = 1200
_KEY_PARTS, _TENSOR_PARTS = 3, 7
# The tokenizer's arrays, as long as the vocabulary or its merges (any other key's array is capped)
_TOKENIZER_ARRAYS = frozenset(f"tokenizer.ggml.{name}" for name in ("tokens", "scores", "token_type", "merges"))
MOST_ARRAY_ELEMENTS = 65_536  # in an array of another key (real files: tags, languages, per-layer sizes)
_MOST_NESTED = 8  # arrays within arrays


def _check_gguf_layout(path: str) -> None:
    """Refuse by name, before gguf.GGUFReader reads a GGUF file, what would hang it with growing memory:
    it makes a numpy view of every array element (`_READER_BYTES_PER_PART`), so that a 16 MB file of one
    array of 2 million empty strings held it for half a minute and 3 GB. Walks the header (magic, version,
    tensor count, metadata count), each metadata entry (key string, value type, value: an array is an
    element type, a count and the elements; a string a 64-bit length and its bytes) and each tensor's
    info (name, dimensions, type, offset), reading lengths and counts only and skipping the bytes
    between. Refused: a count or length that runs past the file's end (a truncated or crafted file);
    an array of more than MOST_ARRAY_ELEMENTS elements but the tokenizer's (`_TOKENIZER_ARRAYS`, as long
    as its vocabulary: Llama 3's 128k tokens and 280k merges), or nested more than `_MOST_NESTED` deep;
    and what the reader would hold in more memory than `check_memory` allows."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        _GgufWalk(path, data).walk()


class _GgufWalk:
    """One walk of `_check_gguf_layout`: where it is in the file, and the parts the reader will hold."""

    def __init__(self, path: str, data: mmap.mmap):
        self.path, self.data, self.at, self.parts = path, data, 4, 0  # past the magic, checked before
        self.budget = memory_limit().size / 2 / _READER_BYTES_PER_PART  # the parts check_memory allows
        # the gguf package reads a file whose version has zero low bytes as of the other byte order
        self.order: Literal["little", "big"] = "little" if int.from_bytes(data[4:6], "little") else "big"
        self.u64 = struct.Struct(("<" if self.order == "little" else ">") + "Q")

    def walk(self) -> None:
        version = self.number(4, "its header")
        if version not in _GGUF_VERSIONS:
            raise OptionError(
                "{pretrained} {0}: unreadable GGUF file (version {1}; the gguf package reads versions {2})",
                self.path,
                version,
                ", ".join(map(str, _GGUF_VERSIONS)),
            )
        tensors, entries = self.number(8, "its header"), self.number(8, "its header")
        counts = f"its {entries:,} metadata entries and {tensors:,} tensors"
        self.fits(entries * _GGUF_LEAST_ENTRY + tensors * _GGUF_LEAST_TENSOR, counts)
        self.hold(entries * _KEY_PARTS + tensors * _TENSOR_PARTS, counts)
        for index in range(entries):
            key = self.text(f"metadata entry {index}'s key")
            self.value(self.number(4, f"metadata {key!r}"), key, 0)
        for index in range(tensors):
            name = self.text(f"tensor {index}'s name")
            self.skip(8 * self.number(4, f"tensor {name!r}") + 4 + 8, f"tensor {name!r}")
        self.hold(0, counts)  # with the strings and numbers counted since

    def value(self, kind: int, key: str, depth: int) -> None:
        """Skip one value of type `kind` of metadata `key`, counting its parts."""
        where = f"metadata {key!r}"
        if kind in _GGUF_FIXED_BYTES:
            self.skip(_GGUF_FIXED_BYTES[kind], where)
            self.parts += 1
        elif kind == _GGUF_STRING:
            self.skip(self.number(8, where), where)
            self.parts += 2
        elif kind == _GGUF_ARRAY:
            if depth == _MOST_NESTED:
                raise OptionError(
                    "{pretrained} {0}: {1} nests arrays more than {2} deep", self.path, where, _MOST_NESTED
                )
            element, count = self.number(4, where), self.number(8, where)
            self.array(element, count, key, depth)
        else:
            raise OptionError(
                "{pretrained} {0}: unreadable GGUF file ({1} has value type {2}, which GGUF does not define)",
                self.path,
                where,
                kind,
            )

    def array(self, element: int, count: int, key: str, depth: int) -> None:
        """Skip the `count` elements of type `element` of an array of metadata `key`, counting their parts."""
        where = f"metadata {key!r}, an array of {count:,} elements"
        least = {_GGUF_STRING: 8, _GGUF_ARRAY: 12}.get(element, _GGUF_FIXED_BYTES.get(element, 1))
        self.fits(count * least, where)
        if count > MOST_ARRAY_ELEMENTS and key not in _TOKENIZER_ARRAYS:
            raise OptionError(
                "{pretrained} {0}: {1}; madp reads at most {2:,} in an array outside the tokenizer's "
                "({3}): the gguf package makes an object of each",
                self.path,
                where,
                MOST_ARRAY_ELEMENTS,
                ", ".join(sorted(_TOKENIZER_ARRAYS)),
            )
        own_parts = 1 if element in _GGUF_FIXED_BYTES else 2 if element == _GGUF_STRING else 0  # arrays: their own
        self.hold(2 + count * own_parts, where)
        if element in _GGUF_FIXED_BYTES:
            self.skip(count * _GGUF_FIXED_BYTES[element], where)
        elif element == _GGUF_STRING:
            at, end, length = self.at, len(self.data), self.u64.unpack_from
            for _ in range(count):
                if at + 8 > end:  # a length past the end
                    at += 8
                    break
                at += 8 + length(self.data, at)[0]
            self.skip(at - self.at, where)  # refused where a length or a string runs past the end
        else:
            for _ in range(count):
                self.value(element, key, depth + 1)

    def number(self, size: int, what: str) -> int:
        """An unsigned integer of `size` bytes."""
        start = self.skip(size, what)
        return int.from_bytes(self.data[start : start + size], self.order)

    def text(self, what: str) -> str:
        """A string, as shown in an error: its first 100 bytes."""
        length = self.number(8, what)
        start = self.skip(length, what)
        shown = self.data[start : start + min(length, 100)].decode("utf-8", "replace")
        return shown + ("..." if length > 100 else "")

    def skip(self, size: int, what: str) -> int:
        """Where `size` bytes start, skipped; refused where they run past the file's end."""
        self.fits(size, what)
        start, self.at = self.at, self.at + size
        return start

    def fits(self, size: int, what: str) -> None:
        if size > len(self.data) - self.at:
            raise OptionError(
                "{pretrained} {0}: unreadable GGUF file ({1}: past the end of its {2:,} bytes; a truncated "
                "or crafted file)",
                self.path,
                what,
                len(self.data),
            )

    def hold(self, parts: int, what: str) -> None:
        """`parts` more held by the reader, refused past what the memory check allows."""
        self.parts += parts
        if self.parts > self.budget:
            check_memory(
                self.parts * _READER_BYTES_PER_PART,
                f"--pretrained {self.path}: {what}, read by the gguf package with what comes before "
                f"(a numpy view of each element, about 1 KB), would hold",
                "check the file (a real model's tokenizer holds a few hundred thousand entries), or read it on a "
                "machine with more memory",
            )


# GGUF metadata value types (GGUFValueType names) of the keys that hold numbers
_INTEGER_TYPES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
_NUMBER_TYPES = (*_INTEGER_TYPES, "FLOAT32", "FLOAT64")


class _Fields:
    """The metadata of a GGUF file by key, as Python values of the type each key needs: a value of
    another type (a string where an integer belongs), or out of range, is an InputError naming the key."""

    _REQUIRED = object()

    def __init__(self, path: str, reader: Any):
        self.path, self.fields = path, reader.fields

    def whole(self, key: str, default: Any = _REQUIRED, least: int = 1) -> int:
        """An integer of at least `least`."""
        found, value = self._get(key, default, _INTEGER_TYPES, f"a whole number of at least {least}")
        if found and value < least:
            raise self.wrong(key, repr(value), f"a whole number of at least {least}")
        return int(value)

    def number(self, key: str, default: Any = _REQUIRED) -> float:
        """A positive, finite number."""
        found, value = self._get(key, default, _NUMBER_TYPES, "a positive finite number")
        if found and not (math.isfinite(value) and value > 0):
            raise self.wrong(key, repr(value), "a positive finite number")
        return float(value)

    def text(self, key: str, default: Any = _REQUIRED) -> str:
        return self._get(key, default, ("STRING",), "a string")[1]

    def texts(self, key: str) -> list[str]:
        return self._get(key, self._REQUIRED, ("STRING",), "an array of strings", array=True)[1]

    def wholes(self, key: str, default: list[int]) -> list[int]:
        return self._get(key, default, _INTEGER_TYPES, "an array of integers", array=True)[1]

    def wrong(self, key: str, what: str, needed: str) -> InputError:
        return OptionError("{pretrained} {0}: {1} is {2}, not {3}", self.path, key, what, needed)

    def _get(self, key: str, default: Any, kinds: tuple[str, ...], needed: str, array: bool = False) -> tuple:
        """(True, the key's value) if its type (GGUFValueType's name; its items' for an array) is one
        of `kinds`, else an InputError; (False, default) where the key is absent."""
        field = self.fields.get(key)
        if field is None:
            if default is self._REQUIRED:
                raise OptionError("{pretrained} {0}: the GGUF metadata has no {1!r}", self.path, key)
            return False, default
        types = [kind.name for kind in field.types]
        shaped = types[:1] == ["ARRAY"] and len(types) == 2 if array else len(types) == 1
        if not (shaped and types[-1] in kinds):
            raise self.wrong(key, self._shown(field, types), needed)
        try:
            return True, field.contents()
        except UnicodeDecodeError as error:
            raise self.wrong(key, f"text that is not UTF-8 ({error.reason})", needed) from None

    @staticmethod
    def _shown(field: Any, types: list[str]) -> str:
        """A value of an unexpected type, for an error: a scalar and its type, else the array's types."""
        if len(types) != 1 or types == ["ARRAY"]:
            return f"an array ({' of '.join(types) or 'no type'})"
        try:
            return f"{field.contents()!r} ({types[0]})"
        except UnicodeDecodeError:
            return f"text that is not UTF-8 ({types[0]})"


def _tokenizer(path: str, fields: _Fields, tokens: list[str]) -> BpeTokenizer:
    """The file's byte-level BPE tokenizer: its special token ids among its tokens, and every byte's
    symbol and every merge in its vocabulary (`check_vocabulary`), so that any text tokenizes."""
    model, pre = fields.text("tokenizer.ggml.model"), fields.text("tokenizer.ggml.pre", "gpt2")
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise OptionError(
            "{pretrained} {0}: tokenizer {1!r} with pre-tokenizer {2!r}; madp implements byte-level "
            "BPE ('gpt2') with the pre-tokenizers {3}",
            path,
            model,
            pre,
            list(PRE_TOKENIZERS),
        )
    types = fields.wholes("tokenizer.ggml.token_type", [])
    eos = fields.whole("tokenizer.ggml.eos_token_id", least=0)
    special = {
        "eos": eos,
        "bos": fields.whole("tokenizer.ggml.bos_token_id", eos, least=0),
        "padding": fields.whole("tokenizer.ggml.padding_token_id", eos, least=0),
    }
    for name, token in special.items():
        if token >= len(tokens):
            listed = f"a token id (tokenizer.ggml.tokens lists {len(tokens)})"
            raise fields.wrong(f"tokenizer.ggml.{name}_token_id", repr(token), listed)
    merges = fields.texts("tokenizer.ggml.merges")
    check_vocabulary(
        set(tokens),
        merges,
        lambda why: OptionError("{pretrained} {0}: {1}", path, why),
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges entry",
    )
    return BpeTokenizer(
        tokens=tokens,
        merges=merges,
        bos=special["bos"],
        eos=eos,
        pad=special["padding"],
        pre_tokenizer=pre,
        control=frozenset(i for i, kind in enumerate(types) if kind == CONTROL_TOKEN),
    )


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter on a query or key projection [heads * head_dim, n_in]: it wrote the
    rows of each head as reshape(heads, 2, head_dim / 2).swapaxes(1, 2), interleaving the two halves
    that Hugging Face's RoPE rotates together into adjacent pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _gguf_weights(path: str, tensors: dict[str, Any], config: LlamaConfig) -> dict[str, list[np.ndarray]]:
    """The weights of each layer of `llama_model`, by layer name, from the GGUF tensors (by name)."""
    import gguf

    def tensor(name: str) -> np.ndarray:
        """A tensor dequantized to float32, in numpy's order of GGUF's shape reversed ([n_out, n_in])
        (`read_gguf` checked that each is there, of the configuration's shape)."""
        found = tensors[name]
        try:
            values = gguf.quants.dequantize(np.asarray(found.data), found.tensor_type)
        except NotImplementedError as error:  # a type gguf cannot dequantize (an integer tensor, say)
            raise OptionError("{pretrained} {0}: tensor {1!r} cannot be read ({2})", path, name, str(error)) from None
        shape = tuple(int(n) for n in reversed(found.shape.tolist()))
        return finite_weights(path, f"tensor {name!r}", np.asarray(values, dtype=np.float32).reshape(shape))

    c = config
    weights = {"token_embd": [tensor("token_embd.weight")], "output_norm": [tensor("output_norm.weight")]}
    if not c.tied_output:
        weights["output"] = [tensor("output.weight").T]
    for i in range(c.layers):
        block = f"blk.{i}."
        weights[f"blk_{i}_attn_norm"] = [tensor(block + "attn_norm.weight")]
        weights[f"blk_{i}_ffn_norm"] = [tensor(block + "ffn_norm.weight")]
        weights[f"blk_{i}_attn_q"] = [_unpermute(tensor(block + "attn_q.weight"), c.heads).T]
        weights[f"blk_{i}_attn_k"] = [_unpermute(tensor(block + "attn_k.weight"), c.kv_heads).T]
        for name in ("attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            weights[f"blk_{i}_{name}"] = [tensor(f"{block}{name}.weight").T]
    return weights
