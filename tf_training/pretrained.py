"""A pretrained Llama-architecture causal language model, read from a GGUF file (llama.cpp's format) or
a keras-hub preset directory (what `save_to_preset` writes), without llama.cpp or keras-hub.

- `read_pretrained(path)`: the configuration (`LlamaConfig`), the byte-level BPE tokenizer
  (`BpeTokenizer`: a GGUF file's vocabulary and merges from its metadata; a preset's from
  `assets/tokenizer/`) and, read when loaded, the weights: GGUF tensors dequantized to float32 with the
  `gguf` package, or a preset's `model.weights.h5` read with h5py.
- `llama_model(config)`: the architecture in tf_keras: token embedding, N blocks of RMSNorm ->
  grouped-query causal self-attention with rotary position embeddings -> residual, RMSNorm ->
  SwiGLU MLP -> residual, then a final RMSNorm and the LM head (the embedding, transposed, when the
  file has no `output.weight`). Projections are plain Dense layers; the custom layers (RMSNorm, the
  weightless rotary attention, the tied embedding) are registered for model.keras.
- `load_weights(model, pretrained)`: the file's tensors into that model.

Preset facts this relies on (keras-hub 0.32's LlamaBackbone and Llama3Backbone): `config.json` names
the backbone class and its sizes; `model.weights.h5` holds each layer's variables under
`layers/<layer>/.../vars/<i>`, the decoder blocks as `llama_transformer_decoder`, `..._1`, ... in
order; attention kernels are EinsumDense [width, heads, head_dim] (output: [heads, head_dim, width])
and its RoPE rotates halves, like Hugging Face's; `reversible_embedding/vars/1`, when present, is the
separate LM head [width, vocabulary].

GGUF facts this relies on: a 2-D tensor of GGUF shape [n_in, n_out] is stored row-major as a numpy
array [n_out, n_in] (PyTorch's Linear layout; a Keras kernel is its transpose), and llama.cpp's
converter permutes the rows of the query and key projections of each head so that its RoPE rotates
adjacent pairs (2i, 2i+1); Hugging Face's Llama rotates the two halves (i, i + d/2). `_unpermute`
undoes the converter's permutation, so the Keras model rotates halves like the original checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
import math
import mmap
import os
import re
import struct
import sys
import unicodedata
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any, Literal

import numpy as np

from madp.core.errors import InputError, check_memory, memory_limit
from madp.training import load_tensorflow, text

tf = load_tensorflow()
import tf_keras  # noqa: E402

ARCHITECTURE = "llama"
GGUF_MAGIC = b"GGUF"
CONTROL_TOKEN = 3  # tokenizer.ggml.token_type of special tokens (<|endoftext|>, <|im_start|>, ...)
# Pre-tokenizers implemented here, by llama.cpp's names (tokenizer.ggml.pre): GPT-2's byte-level
# regex; SmolLM's, which first splits every digit off on its own (Hugging Face's
# Digits(individual_digits=True)); Llama 3's ("llama-bpe"), which keras-hub's BytePairTokenizer also
# applies on its Python path.
PRE_TOKENIZERS = ("gpt2", "smollm", "llama-bpe")
# keras-hub backbones of this architecture, and the tokenizer class whose special tokens madp knows
PRESET_BACKBONES = ("LlamaBackbone", "Llama3Backbone")
PRESET_TOKENIZER = "Llama3Tokenizer"
LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"  # what keras-hub's Llama3Tokenizer uses


# --- reading the file ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The architecture's sizes, from the GGUF metadata (`llama.*` keys)."""

    vocabulary: int
    layers: int  # llama.block_count
    width: int  # llama.embedding_length
    hidden: int  # llama.feed_forward_length: the SwiGLU MLP's inner width
    heads: int  # llama.attention.head_count
    kv_heads: int  # llama.attention.head_count_kv: query heads share K/V heads in groups
    head_dim: int  # llama.rope.dimension_count, else width / heads
    rope_base: float  # llama.rope.freq_base: the rotary frequencies are base^(-2i/head_dim)
    norm_epsilon: float  # llama.attention.layer_norm_rms_epsilon
    context_length: int | None  # llama.context_length: the longest sequence it was trained on (None: not said)
    tied_output: bool  # no separate LM head: it is the token embedding, transposed


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A pretrained model: where it is, its configuration and tokenizer, and `layer_weights()`, which
    reads its weights as float32 arrays by layer name of `llama_model` (in get_weights() order)."""

    path: str
    config: LlamaConfig
    tokenizer: BpeTokenizer
    layer_weights: Callable[[], dict[str, list[np.ndarray]]]


def read_pretrained(path: str) -> Pretrained:
    """The configuration and tokenizer of a Llama-architecture model in a GGUF file or a keras-hub
    preset directory (InputError if it is missing, unreadable, or holds another architecture or
    tokenizer); its weights are read by `layer_weights()`. A GGUF file's metadata is checked before
    any model is built: each value's type, the sizes against the tensors the file stores, the
    tokenizer's ids and symbols against its vocabulary, and the model's size against memory."""
    if os.path.isdir(path):
        return read_preset(path)
    reader = _open_gguf(path)
    fields = _Fields(path, reader)
    architecture = fields.text("general.architecture")
    if architecture != ARCHITECTURE:
        raise InputError(
            f"--pretrained {path}: a {architecture!r} model; madp implements the {ARCHITECTURE!r} architecture only"
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
    _check_sizes(path, config)
    if len(tokens) != config.vocabulary:
        raise InputError(
            f"--pretrained {path}: llama.vocab_size is {config.vocabulary}, but tokenizer.ggml.tokens lists "
            f"{len(tokens)} tokens"
        )
    _check_gguf_tensors(path, config, tensors)
    _check_memory(path, config)
    return Pretrained(
        path, config, _tokenizer(path, fields, tokens), functools.partial(gguf_weights, path, tensors, config)
    )


def _check_sizes(path: str, config: LlamaConfig) -> None:
    sizes = (config.vocabulary, config.layers, config.width, config.hidden, config.heads, config.kv_heads)
    if min(sizes) < 1 or config.heads % config.kv_heads or config.head_dim * config.heads != config.width:
        raise InputError(f"--pretrained {path}: inconsistent sizes {config}")
    if config.head_dim % 2:  # RoPE rotates the two halves of a head
        raise InputError(f"--pretrained {path}: an odd head size {config.head_dim}")


def parameter_count(config: LlamaConfig) -> int:
    """The number of weights of `llama_model(config)` (LoRA adapters aside)."""
    c = config
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    block = 2 * c.width + 2 * c.width * q + 2 * c.width * kv + 3 * c.width * c.hidden
    return c.vocabulary * c.width * (1 if c.tied_output else 2) + c.width + c.layers * block


def _check_memory(path: str, config: LlamaConfig) -> None:
    """Refuse, before any model is built, a model whose float32 weights and their copy read from the
    file would fill more than half of this machine's memory (a file can state sizes that its bytes
    do not hold: quantized, or GGUF tensors that share their bytes)."""
    parameters = parameter_count(config)
    check_memory(
        8 * parameters,
        f"--pretrained {path}: its {parameters:,} weights in float32, with their copy read from the file, hold",
        "fine-tune a smaller model, or on a machine with more memory",
    )


def gguf_tensor_shapes(config: LlamaConfig) -> dict[str, tuple[tuple[int, ...], str]]:
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
        raise InputError(
            f"--pretrained {path}: llama.block_count is {config.layers}, but the file holds the tensors of "
            f"{len(blocks)} blocks ({held})"
        )
    for name, (shape, given_by) in gguf_tensor_shapes(config).items():
        found = tensors.get(name)
        if found is None:
            raise InputError(f"--pretrained {path}: no tensor {name!r} (a {ARCHITECTURE} model has one)")
        stored = tuple(int(n) for n in reversed(found.shape.tolist()))
        if stored != shape:
            raise InputError(
                f"--pretrained {path}: tensor {name!r} has shape {stored}, where the metadata gives {shape}: {given_by}"
            )


def check_pretrained_path(path: str) -> None:
    """`read_pretrained`'s first checks, which read no more than a header or config.json: a GGUF file,
    or a directory with a JSON config.json. `madp train` makes them before it hashes the model's files,
    so that a path holding no model is refused at once."""
    if os.path.isdir(path):
        _preset_json(path, "config.json")
        return
    if not os.path.isfile(path):
        raise InputError(f"--pretrained {path}: no such file (a local .gguf file; `make pretrained` fetches one)")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise InputError(f"--pretrained {path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


def _open_gguf(path: str):
    check_pretrained_path(path)
    check_gguf_layout(path)
    try:
        import gguf
    except ImportError as error:
        raise InputError("reading a GGUF file needs the gguf package: pip install -e '.[train]'") from error
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, EOFError) as error:  # truncated or corrupt
        raise InputError(f"--pretrained {path}: unreadable GGUF file ({type(error).__name__}: {error})") from None


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


def check_gguf_layout(path: str) -> None:
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
    """One walk of `check_gguf_layout`: where it is in the file, and the parts the reader will hold."""

    def __init__(self, path: str, data: mmap.mmap):
        self.path, self.data, self.at, self.parts = path, data, 4, 0  # past the magic, checked before
        self.budget = memory_limit().size / 2 / _READER_BYTES_PER_PART  # the parts check_memory allows
        # the gguf package reads a file whose version has zero low bytes as of the other byte order
        self.order: Literal["little", "big"] = "little" if int.from_bytes(data[4:6], "little") else "big"
        self.u64 = struct.Struct(("<" if self.order == "little" else ">") + "Q")

    def walk(self) -> None:
        version = self.number(4, "its header")
        if version not in _GGUF_VERSIONS:
            raise InputError(
                f"--pretrained {self.path}: unreadable GGUF file (version {version}; the gguf package reads "
                f"versions {', '.join(map(str, _GGUF_VERSIONS))})"
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
                raise InputError(f"--pretrained {self.path}: {where} nests arrays more than {_MOST_NESTED} deep")
            element, count = self.number(4, where), self.number(8, where)
            self.array(element, count, key, depth)
        else:
            raise InputError(f"--pretrained {self.path}: unreadable GGUF file ({where} has value type {kind}, "
                             "which GGUF does not define)")  # fmt: skip

    def array(self, element: int, count: int, key: str, depth: int) -> None:
        """Skip the `count` elements of type `element` of an array of metadata `key`, counting their parts."""
        where = f"metadata {key!r}, an array of {count:,} elements"
        least = {_GGUF_STRING: 8, _GGUF_ARRAY: 12}.get(element, _GGUF_FIXED_BYTES.get(element, 1))
        self.fits(count * least, where)
        if count > MOST_ARRAY_ELEMENTS and key not in _TOKENIZER_ARRAYS:
            raise InputError(
                f"--pretrained {self.path}: {where}; madp reads at most {MOST_ARRAY_ELEMENTS:,} in an array "
                f"outside the tokenizer's ({', '.join(sorted(_TOKENIZER_ARRAYS))}): the gguf package makes an "
                "object of each"
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
            raise InputError(
                f"--pretrained {self.path}: unreadable GGUF file ({what}: past the end of its "
                f"{len(self.data):,} bytes; a truncated or crafted file)"
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
        return InputError(f"--pretrained {self.path}: {key} is {what}, not {needed}")

    def _get(self, key: str, default: Any, kinds: tuple[str, ...], needed: str, array: bool = False) -> tuple:
        """(True, the key's value) if its type (GGUFValueType's name; its items' for an array) is one
        of `kinds`, else an InputError; (False, default) where the key is absent."""
        field = self.fields.get(key)
        if field is None:
            if default is self._REQUIRED:
                raise InputError(f"--pretrained {self.path}: the GGUF metadata has no {key!r}")
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
    symbol and every merge in its vocabulary (`_check_vocabulary`), so that any text tokenizes."""
    model, pre = fields.text("tokenizer.ggml.model"), fields.text("tokenizer.ggml.pre", "gpt2")
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise InputError(
            f"--pretrained {path}: tokenizer {model!r} with pre-tokenizer {pre!r}; madp implements byte-level "
            f"BPE ('gpt2') with the pre-tokenizers {list(PRE_TOKENIZERS)}"
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
    _check_vocabulary(
        set(tokens),
        merges,
        lambda why: InputError(f"--pretrained {path}: {why}"),
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


def _check_vocabulary(
    vocabulary: Container[str], merges: Sequence[str], bad: Callable[[str], InputError], tokens: str, merge: str
) -> None:
    """That a byte-level BPE vocabulary holds the symbol of every byte, and every merge is two of its
    tokens whose merge it holds too: else a text would tokenize to a symbol that has no id. `tokens`
    and `merge` name where the vocabulary and a merge come from, for the error."""
    missing = [symbol for symbol in byte_symbols() if symbol not in vocabulary]
    if missing:
        raise bad(f"{tokens} lacks the symbols of {len(missing)} bytes (e.g. {missing[0]!r})")
    for number, pair in enumerate(merges, 1):
        parts = pair.split(" ")
        if len(parts) != 2 or not all(symbol and symbol in vocabulary for symbol in (*parts, "".join(parts))):
            raise bad(f"{merge} {number} ({pair!r}) is not two tokens of the vocabulary whose merge is in it too")


# --- reading a keras-hub preset ------------------------------------------------------------------


def read_preset(path: str) -> Pretrained:
    """A keras-hub preset directory of a Llama backbone (`PRESET_BACKBONES`, no RoPE scaling) with a
    Llama 3 byte-level BPE tokenizer: `config.json`, `model.weights.h5`, `tokenizer.json` and
    `assets/tokenizer/{vocabulary.json, merges.txt}`. Sizes, the weights' shapes and blocks, and the
    tokenizer are checked here, before any model is built."""
    backbone = _preset_json(path, "config.json")
    if backbone.get("class_name") not in PRESET_BACKBONES:
        raise InputError(
            f"--pretrained {path}: a {backbone.get('class_name')!r} preset; madp reads the keras-hub backbones "
            f"{list(PRESET_BACKBONES)}"
        )
    c = backbone.get("config")
    if not isinstance(c, dict):
        raise InputError(f"--pretrained {path}: config.json has no backbone configuration ('config')")
    scaled = {key: c.get(key) for key in ("rope_position_scaling_factor", "rope_frequency_adjustment_factor")}
    if scaled["rope_position_scaling_factor"] not in (None, 1, 1.0) or scaled["rope_frequency_adjustment_factor"]:
        raise InputError(f"--pretrained {path}: RoPE scaling ({scaled}) is not implemented; madp's RoPE is unscaled")
    if not os.path.isfile(os.path.join(path, "model.weights.h5")):
        raise InputError(f"--pretrained {path}: no model.weights.h5 (sharded preset weights are not read)")
    blocks, tied, embedding = _weights_outline(path)
    number = functools.partial(_config_number, path, c)
    width, heads = number("hidden_dim"), number("num_query_heads")
    context = c.get("rope_pretraining_sequence_length")
    config = LlamaConfig(
        vocabulary=number("vocabulary_size"),
        layers=number("num_layers"),
        width=width,
        hidden=number("intermediate_dim"),
        heads=heads,
        kv_heads=number("num_key_value_heads", default=heads),
        head_dim=width // heads,
        rope_base=number("rope_max_wavelength", default=10000.0, whole=False),
        norm_epsilon=number("layer_norm_epsilon", default=1e-6, whole=False),
        context_length=None if context is None else number("rope_pretraining_sequence_length"),
        tied_output=tied,
    )
    _check_sizes(path, config)
    if blocks != config.layers:
        raise InputError(
            f"--pretrained {path}: model.weights.h5 holds {blocks} decoder blocks, config.json says {config.layers}"
        )
    if embedding != (config.vocabulary, config.width):  # before a model of the configured size is built
        raise InputError(
            f"--pretrained {path}: {_EMBEDDING} has shape {embedding}, config.json says "
            f"{(config.vocabulary, config.width)}"
        )
    _check_memory(path, config)
    tokenizer = _preset_tokenizer(path, config.vocabulary)
    return Pretrained(path, config, tokenizer, functools.partial(preset_weights, path, config))


def _config_number(path: str, config: dict, key: str, default: float | None = None, whole: bool = True) -> Any:
    """A positive, finite number of config.json (a whole one where `whole`), or `default` if absent."""
    value = config.get(key, default)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        if not whole:
            return float(value)
        if value == int(value):
            return int(value)
    kind = "a positive whole number" if whole else "a positive finite number"
    raise InputError(f"--pretrained {path}: config.json {key} is {value!r}, not {kind}")


def _preset_json(path: str, name: str) -> dict:
    try:
        with open(os.path.join(path, name), encoding="utf-8") as handle:
            value = json.load(handle)
    except FileNotFoundError:
        raise InputError(f"--pretrained {path}: a directory without {name} (not a keras-hub preset)") from None
    except (OSError, ValueError, RecursionError) as error:
        raise InputError(f"--pretrained {path}: unreadable {name} ({type(error).__name__})") from None
    if not isinstance(value, dict):
        raise InputError(f"--pretrained {path}: {name} is not a JSON object")
    return value


def _preset_tokenizer(path: str, model_vocabulary: int) -> BpeTokenizer:
    """keras-hub's Llama3Tokenizer: its vocabulary and merges, Llama 3's pre-tokenizer, and its special
    tokens (`unsplittable_tokens`) as control tokens. The vocabulary must give every token a distinct
    id below the model's vocabulary and hold every byte's symbol and every merge's result, so that
    any text tokenizes."""
    tokenizer = _preset_json(path, "tokenizer.json")
    assets = os.path.join(path, "assets", "tokenizer")
    if tokenizer.get("class_name") != PRESET_TOKENIZER:
        raise InputError(
            f"--pretrained {path}: a {tokenizer.get('class_name')!r} tokenizer; madp reads keras-hub's "
            f"{PRESET_TOKENIZER} (byte-level BPE; SentencePiece tokenizers are not implemented)"
        )
    settings = tokenizer.get("config")
    settings = settings if isinstance(settings, dict) else {}
    if settings.get("add_prefix_space"):
        raise InputError(f"--pretrained {path}: a tokenizer with add_prefix_space is not implemented")
    special = settings.get("unsplittable_tokens", [LLAMA3_BOS, LLAMA3_EOS])
    if not isinstance(special, list) or not all(isinstance(token, str) for token in special):
        raise InputError(f"--pretrained {path}: tokenizer.json unsplittable_tokens is not a list of strings")

    def bad(why: str) -> InputError:
        return InputError(f"--pretrained {path}: {assets}: {why}")

    try:
        with open(os.path.join(assets, "vocabulary.json"), encoding="utf-8") as handle:
            vocabulary = json.load(handle)
        with open(os.path.join(assets, "merges.txt"), encoding="utf-8") as handle:
            lines = [line.rstrip("\n") for line in handle]
    except (OSError, ValueError, RecursionError) as error:
        raise bad(f"unreadable ({type(error).__name__}: {error})") from None
    if not isinstance(vocabulary, dict) or not vocabulary:
        raise bad("vocabulary.json is not a non-empty JSON object of token ids")
    ids = list(vocabulary.values())
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < model_vocabulary for i in ids):
        raise bad(f"vocabulary.json ids must be whole numbers in [0, {model_vocabulary}) (the model's vocabulary)")
    if len(set(ids)) != len(ids):
        raise bad("vocabulary.json gives two tokens the same id")
    merges = [line for line in lines if line and not line.startswith("#version")]
    _check_vocabulary(vocabulary, merges, bad, "vocabulary.json", "merges.txt line")
    for token in (LLAMA3_BOS, LLAMA3_EOS):
        if token not in vocabulary:
            raise bad(f"vocabulary.json has no {token}")
    tokens = [""] * (max(ids) + 1)
    for token, index in vocabulary.items():
        tokens[index] = token
    control = frozenset(vocabulary[token] for token in special if token in vocabulary)
    # keras-hub pads Llama 3 with id 0; padding is never attended to (attention is causal) nor scored
    return BpeTokenizer(
        tokens,
        merges,
        bos=vocabulary[LLAMA3_BOS],
        eos=vocabulary[LLAMA3_EOS],
        pad=0,
        pre_tokenizer="llama-bpe",
        control=control,
    )


_EMBEDDING = "layers/reversible_embedding/vars/0"
_HEAD = "layers/reversible_embedding/vars/1"  # a separate LM head; absent when tied to the embedding
_BLOCK = re.compile(r"llama_transformer_decoder(_[1-9][0-9]*)?")  # block 0, 1, 2, ... in order


def _weights_outline(path: str) -> tuple[int, bool, tuple[int, ...] | None]:
    """What model.weights.h5 holds, read before any model is built: its number of decoder blocks
    (their groups under `layers/`), whether the LM head is tied (no separate head), and the token
    embedding's shape."""
    import h5py

    with _open_h5(path) as store:
        layers = store.get("layers")
        names = layers.keys() if isinstance(layers, h5py.Group) else ()
        embedding = store.get(_EMBEDDING)
        return (
            sum(bool(_BLOCK.fullmatch(name)) for name in names),
            not isinstance(store.get(_HEAD), h5py.Dataset),
            tuple(embedding.shape) if isinstance(embedding, h5py.Dataset) else None,
        )


def _open_h5(path: str):
    """model.weights.h5 of a preset, open for reading (InputError if it is not an HDF5 file)."""
    import h5py

    try:
        return h5py.File(os.path.join(path, "model.weights.h5"), "r")
    except OSError as error:
        raise InputError(f"--pretrained {path}: model.weights.h5 is not a readable HDF5 file ({error})") from None


def _float32(dataset) -> np.ndarray:
    """A weight as float32: floating-point data, or Keras 3's bfloat16 (2-byte opaque data with
    attrs["dtype"] "bfloat16": the upper half of a float32)."""
    values = dataset[()]
    kind = dataset.attrs.get("dtype")
    if values.dtype.kind == "V" and values.dtype.itemsize == 2 and kind in ("bfloat16", b"bfloat16"):
        return (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if values.dtype.kind != "f":
        raise ValueError(f"{values.dtype} data, not floating point")
    return values.astype(np.float32)


def preset_weights(path: str, config: LlamaConfig) -> dict[str, list[np.ndarray]]:
    """The weights of each layer of `llama_model`, by layer name, from a preset's model.weights.h5:
    each dataset must have exactly the shape keras-hub gives it (attention kernels [width, heads,
    head_dim], the output projection [heads, head_dim, width]), reshaped to madp's Dense kernels."""
    import h5py

    c = config
    with _open_h5(path) as store:

        def read(key: str, stored: tuple[int, ...], shape: tuple[int, ...] | None = None) -> list[np.ndarray]:
            found = store.get(key)
            if not isinstance(found, h5py.Dataset):
                raise InputError(f"--pretrained {path}: model.weights.h5 has no dataset {key!r}")
            # The preset's digest covers its files' bytes: a weight read from elsewhere (an external
            # link, external or virtual storage) could change while the digest does not.
            if found.file.filename != store.filename or found.external or found.is_virtual:
                raise InputError(
                    f"--pretrained {path}: {key} in model.weights.h5 is stored in another file; a preset's "
                    f"weights must lie in model.weights.h5 itself"
                )
            if tuple(found.shape) != stored:
                raise InputError(f"--pretrained {path}: {key} has shape {tuple(found.shape)}, expected {stored}")
            try:
                values = _float32(found)
            except (TypeError, ValueError, OSError, KeyError) as error:
                raise InputError(f"--pretrained {path}: unreadable {key} in model.weights.h5 ({error})") from None
            return [finite_weights(path, f"{key} in model.weights.h5", values).reshape(shape or stored)]

        q, kv, d = c.heads * c.head_dim, c.kv_heads * c.head_dim, c.head_dim
        weights = {
            "token_embd": read(_EMBEDDING, (c.vocabulary, c.width)),
            "output_norm": read("layers/llama_layer_norm/vars/0", (c.width,)),
        }
        if not c.tied_output:
            weights["output"] = read(_HEAD, (c.width, c.vocabulary))
        for i in range(c.layers):
            block = "layers/llama_transformer_decoder" + (f"_{i}" if i else "") + "/"
            for name, key, stored, shape in (
                ("attn_norm", "_self_attention_layernorm", (c.width,), None),
                ("ffn_norm", "_feedforward_layernorm", (c.width,), None),
                ("attn_q", "_self_attention_layer/_query_dense", (c.width, c.heads, d), (c.width, q)),
                ("attn_k", "_self_attention_layer/_key_dense", (c.width, c.kv_heads, d), (c.width, kv)),
                ("attn_v", "_self_attention_layer/_value_dense", (c.width, c.kv_heads, d), (c.width, kv)),
                ("attn_output", "_self_attention_layer/_output_dense", (c.heads, d, c.width), (q, c.width)),
                ("ffn_gate", "_feedforward_gate_dense", (c.width, c.hidden), None),
                ("ffn_up", "_feedforward_intermediate_dense", (c.width, c.hidden), None),
                ("ffn_down", "_feedforward_output_dense", (c.hidden, c.width), None),
            ):
                weights[f"blk_{i}_{name}"] = read(f"{block}{key}/vars/0", stored, shape)
    return weights


# --- the tokenizer ------------------------------------------------------------------------------


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


def text_prefix(text: str | bytes, characters: int) -> str:
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
            text = text_prefix(text, limit * PIECE_READ)
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


# --- the model ----------------------------------------------------------------------------------


@tf_keras.saving.register_keras_serializable(package="madp")
class RmsNorm(tf_keras.layers.Layer):
    """Llama's normalization: x / sqrt(mean(x^2) + epsilon) * scale, no centering and no bias."""

    def __init__(self, epsilon: float = 1e-5, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape) -> None:
        self.scale = self.add_weight(name="scale", shape=(int(input_shape[-1]),), initializer="ones")

    def normalized(self, x):
        """x / sqrt(mean(x^2) + epsilon), before the scale (ghost clipping records it); the mean of
        squares in float32 under mixed precision (bfloat16 keeps 8 bits of a sum of width squares)."""
        wide = tf.cast(x, tf.float32)
        scale = tf.math.rsqrt(tf.reduce_mean(tf.square(wide), axis=-1, keepdims=True) + self.epsilon)
        return tf.cast(wide * scale, x.dtype)

    def call(self, x):
        return self.normalized(x) * self.scale

    def get_config(self) -> dict:
        return {**super().get_config(), "epsilon": self.epsilon}


def rotary_angles(length, head_dim: int, base: float):
    """(cos, sin) [length, head_dim] of position p and frequency base^(-2i/head_dim), i < head_dim/2,
    repeated for the two halves of a head that are rotated together."""
    frequencies = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = tf.cast(tf.range(length), tf.float32)[:, None] * tf.constant(frequencies, tf.float32)[None, :]
    angles = tf.concat([angles, angles], axis=-1)
    return tf.cos(angles), tf.sin(angles)


def rotate_halves(x, cos, sin):
    """RoPE in Hugging Face's layout: x * cos + (-x2, x1) * sin, with x1, x2 the halves of a head."""
    first, second = tf.split(x, 2, axis=-1)
    cos, sin = tf.cast(cos, x.dtype), tf.cast(sin, x.dtype)  # bfloat16 under mixed precision
    return x * cos + tf.concat([-second, first], axis=-1) * sin


@tf_keras.saving.register_keras_serializable(package="madp")
class RotaryCausalAttention(tf_keras.layers.Layer):
    """Causal softmax attention of projected queries, keys and values ([n, T, heads * head_dim] and
    [n, T, kv_heads * head_dim]): rotary position embeddings on queries and keys, query head h reads
    K/V head h // (heads / kv_heads) (grouped-query attention). No weights: the projections around
    it are Dense layers."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, rope_base: float, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.kv_heads, self.head_dim, self.rope_base = heads, kv_heads, head_dim, rope_base

    def call(self, inputs):
        queries, keys, values = inputs
        length = tf.shape(queries)[1]
        group = self.heads // self.kv_heads
        cos, sin = rotary_angles(length, self.head_dim, self.rope_base)
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        q = rotate_halves(tf.reshape(queries, [-1, length, self.heads, self.head_dim]), cos, sin)
        k = rotate_halves(tf.reshape(keys, [-1, length, self.kv_heads, self.head_dim]), cos, sin)
        v = tf.reshape(values, [-1, length, self.kv_heads, self.head_dim])
        q = tf.reshape(q, [-1, length, self.kv_heads, group, self.head_dim])  # head h = (h // group, h % group)
        scores = tf.einsum("nqkgd,nskd->nkgqs", q, k) / math.sqrt(self.head_dim)
        causal = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)  # query q sees keys s <= q
        scores = tf.where(causal, scores, tf.constant(-1e9, scores.dtype))
        # softmax over [n, heads, T, T], not [n, kv_heads, group, T, T]: TensorFlow's softmax takes at
        # most 5 dimensions, and per-example gradients (vectorized_map) add one
        # in float32 under mixed precision, as the loss's softmax
        rows = tf.reshape(tf.cast(scores, tf.float32), [-1, self.heads, length, length])
        weights = tf.reshape(tf.cast(tf.nn.softmax(rows), scores.dtype), tf.shape(scores))
        attended = tf.einsum("nkgqs,nskd->nqkgd", weights, v)
        return tf.reshape(attended, [-1, length, self.heads * self.head_dim])

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rope_base": self.rope_base,
        }


@tf_keras.saving.register_keras_serializable(package="madp")
class TiedEmbedding(tf_keras.layers.Layer):
    """A token embedding that is also the LM head: ids -> rows of E, or (reverse) vectors -> x E^T.
    Not a subclass of Embedding, so that clipping does not take its two uses for a lookup alone."""

    def __init__(self, vocabulary: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary, self.width = vocabulary, width

    def build(self, input_shape) -> None:
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.vocabulary, self.width),
            initializer=tf_keras.initializers.RandomNormal(stddev=0.02),
        )

    def call(self, inputs, reverse: bool = False):
        if reverse:
            return tf.einsum("ntd,vd->ntv", inputs, self.embeddings)
        return tf.gather(self.embeddings, tf.cast(inputs, tf.int32))

    def get_config(self) -> dict:
        return {**super().get_config(), "vocabulary": self.vocabulary, "width": self.width}


@tf_keras.saving.register_keras_serializable(package="madp")
class LoraDense(tf_keras.layers.Layer):
    """A pretrained projection x W, frozen, plus a trainable low-rank update (LoRA, Hu et al. 2021):
    x W + (x A) B with A [n_in, rank] random and B [rank, n_out] zero, so the model starts as the
    pretrained one and only A and B are trained, clipped and noised. A and B are Dense layers, so
    ghost clipping's Dense formula gives their per-example gradient norms."""

    def __init__(self, units: int, rank: int, **kwargs):
        super().__init__(**kwargs)
        self.units, self.rank = units, rank
        self.base = tf_keras.layers.Dense(units, use_bias=False, trainable=False, name="base")
        # A uniform in +-1/sqrt(n_in) (the usual LoRA initialization), B zero
        spread = tf_keras.initializers.VarianceScaling(1 / 3, mode="fan_in", distribution="uniform")
        self.adapter_in = tf_keras.layers.Dense(rank, use_bias=False, kernel_initializer=spread, name="lora_a")
        self.adapter_out = tf_keras.layers.Dense(units, use_bias=False, kernel_initializer="zeros", name="lora_b")

    def call(self, x):
        return self.base(x) + self.adapter_out(self.adapter_in(x))

    def get_config(self) -> dict:
        return {**super().get_config(), "units": self.units, "rank": self.rank}


LORA_PROJECTIONS = ("attn_q", "attn_v")  # where --lora-rank puts adapters: the query and value projections


def _dense(units: int, name: str, activation: str | None = None, trainable: bool = True):
    # Llama has no biases
    return tf_keras.layers.Dense(units, use_bias=False, activation=activation, name=name, trainable=trainable)


def llama_model(config: LlamaConfig, length: int | None = None, lora_rank: int = 0):
    """A randomly initialized tf_keras model of the architecture: token ids [n, length] (int32) ->
    next-token logits [n, length, vocabulary]. Layers are named after the GGUF tensors they hold.
    With `lora_rank`, the query and value projections are `LoraDense` and nothing else is trainable."""
    c, trainable = config, not lora_rank  # with LoRA, only the adapters train

    def projection(units: int, block: int, kind: str, activation: str | None = None):
        name = f"blk_{block}_{kind}"
        if lora_rank and kind in LORA_PROJECTIONS:
            return LoraDense(units, lora_rank, name=name)
        return _dense(units, name, activation, trainable=trainable)

    ids = tf_keras.Input(shape=(length,), dtype=tf.int32, name="token_ids")
    if c.tied_output:
        embedding: Any = TiedEmbedding(c.vocabulary, c.width, name="token_embd", trainable=trainable)
    else:
        embedding = tf_keras.layers.Embedding(c.vocabulary, c.width, name="token_embd", trainable=trainable)
    x = embedding(ids)
    for i in range(c.layers):
        h = RmsNorm(c.norm_epsilon, name=f"blk_{i}_attn_norm", trainable=trainable)(x)
        q, k, v = (
            projection(c.heads * c.head_dim, i, "attn_q")(h),
            projection(c.kv_heads * c.head_dim, i, "attn_k")(h),
            projection(c.kv_heads * c.head_dim, i, "attn_v")(h),
        )
        attended = RotaryCausalAttention(c.heads, c.kv_heads, c.head_dim, c.rope_base, name=f"blk_{i}_attention")(
            [q, k, v]
        )
        out = projection(c.width, i, "attn_output")(attended)
        x = tf_keras.layers.Add(name=f"blk_{i}_attn_residual")([x, out])
        h = RmsNorm(c.norm_epsilon, name=f"blk_{i}_ffn_norm", trainable=trainable)(x)
        gated = tf_keras.layers.Multiply(name=f"blk_{i}_ffn_swiglu")(
            [projection(c.hidden, i, "ffn_gate", activation="silu")(h), projection(c.hidden, i, "ffn_up")(h)]
        )
        x = tf_keras.layers.Add(name=f"blk_{i}_ffn_residual")([x, projection(c.width, i, "ffn_down")(gated)])
    x = RmsNorm(c.norm_epsilon, name="output_norm", trainable=trainable)(x)
    logits = embedding(x, reverse=True) if c.tied_output else _dense(c.vocabulary, "output", trainable=trainable)(x)
    return tf_keras.Model(ids, logits, name="llama")


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter on a query or key projection [heads * head_dim, n_in]: it wrote the
    rows of each head as reshape(heads, 2, head_dim / 2).swapaxes(1, 2), interleaving the two halves
    that Hugging Face's RoPE rotates together into adjacent pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def gguf_weights(path: str, tensors: dict[str, Any], config: LlamaConfig) -> dict[str, list[np.ndarray]]:
    """The weights of each layer of `llama_model`, by layer name, from the GGUF tensors (by name)."""
    import gguf

    def tensor(name: str) -> np.ndarray:
        """A tensor dequantized to float32, in numpy's order of GGUF's shape reversed ([n_out, n_in])
        (`read_pretrained` checked that each is there, of the configuration's shape)."""
        found = tensors[name]
        try:
            values = gguf.quants.dequantize(np.asarray(found.data), found.tensor_type)
        except NotImplementedError as error:  # a type gguf cannot dequantize (an integer tensor, say)
            raise InputError(f"--pretrained {path}: tensor {name!r} cannot be read ({error})") from None
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


def finite_weights(path: str, name: str, values: np.ndarray) -> np.ndarray:
    """Weights as read from a file, refused where one is NaN or infinite: the model would compute NaN
    for every row, and DP-SGD, whose clipping gives such a row no weight, would train it on noise alone."""
    if not np.isfinite(values).all():
        raise InputError(f"--pretrained {path}: {name} holds NaN or infinite values")
    return values


def load_weights(model, pretrained: Pretrained) -> None:
    """Set `llama_model(pretrained.config)`'s weights to the pretrained ones (InputError on a shape mismatch)."""
    for name, values in pretrained.layer_weights().items():
        layer = model.get_layer(name)
        layer = layer.base if isinstance(layer, LoraDense) else layer  # the adapters keep their initialization
        expected = [tuple(w.shape) for w in layer.get_weights()]
        if expected != [v.shape for v in values]:
            raise InputError(
                f"--pretrained {pretrained.path}: layer {name} expects shapes {expected}, "
                f"the file holds {[v.shape for v in values]}"
            )
        layer.set_weights(values)


def pretrained_model(pretrained: Pretrained, length: int | None = None, lora_rank: int = 0):
    """`llama_model` of the pretrained configuration with its weights (and LoRA adapters of `lora_rank`)."""
    model = llama_model(pretrained.config, length, lora_rank)
    load_weights(model, pretrained)
    return model


def next_token_loss(targets, logits):
    """Per-example mean next-token cross-entropy (nats) over the example's tokens (targets >= 0)."""
    targets = tf.cast(targets, tf.int32)
    present = tf.cast(targets >= 0, tf.float32)
    logits = tf.cast(logits, tf.float32)  # a softmax over the vocabulary in float32 under mixed precision
    entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.maximum(targets, 0), logits=logits)
    return tf.reduce_sum(entropy * present, axis=-1) / tf.maximum(tf.reduce_sum(present, axis=-1), 1.0)


def token_metrics(total_nats: float, total_tokens: int) -> dict:
    """Mean next-token loss in nats and perplexity exp(loss), over `total_tokens` tokens."""
    nats = total_nats / max(total_tokens, 1)
    return {"loss": round(nats, 6), "perplexity": round(text.perplexity(nats), 4), "tokens": total_tokens}


def mean_token_loss(model, inputs: np.ndarray, targets: np.ndarray, rows_at_once: int = 8) -> dict:
    """`token_metrics` of a model on (inputs, targets), a few rows at a time (logits are [rows, T, V])."""
    return token_metrics(*text.summed_sequence_loss(model, next_token_loss, inputs, targets, rows_at_once))


def greedy_continuation(model, tokenizer: BpeTokenizer, prompt: str, new_tokens: int) -> str:
    """The prompt's most likely next `new_tokens` tokens, one at a time (no cache: for checks, not serving)."""
    ids = [tokenizer.bos, *tokenizer.encode(prompt)]
    for _ in range(new_tokens):
        logits = model(np.array([ids], np.int32), training=False)
        ids.append(int(np.argmax(np.asarray(logits)[0, -1])))
    return tokenizer.decode(ids[len(tokenizer.encode(prompt)) + 1 :])
