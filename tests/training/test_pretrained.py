"""The pretrained causal LM (`--model causal-lm --pretrained PATH.gguf` or a keras-hub preset
directory): the GGUF reader, the byte-level BPE tokenizer, the tf_keras Llama model against an
independent numpy forward pass of a tiny random model written as a GGUF file the way llama.cpp's
converter writes one, keras-hub presets against keras-hub's own logits and token ids, training
without and with DP-SGD and BandMF, LoRA adapters, and bad inputs. With SmolLM2-135M in the cache (`make pretrained`),
also the real model's logits against the numpy forward pass, its loss on English text and a greedy
continuation."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import mmap
import os
import random
import re
import struct
import time
import tracemalloc
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DATA
from reference import gpt2_byte_symbols, reference_bpe_tokens

pytest.importorskip("tensorflow")
gguf = pytest.importorskip("gguf")

from madp.core.batch_files import Feature  # noqa: E402
from madp.core.errors import InputError  # noqa: E402
from madp.core.options import error_text  # noqa: E402
from madp.core.selection import BoundOptions  # noqa: E402
from madp.engines.batch_local import run_local as batch_local  # noqa: E402
from madp.engines.batching import BatchOptions  # noqa: E402
from madp.engines.local_engine import run_local as bound_local  # noqa: E402
from madp.tools.data.synthetic import GraphSpec, generate, to_table  # noqa: E402
from madp.training import bpe_tokenizer, gguf_file, keras_hub_preset, pretrained  # noqa: E402
from madp.training import text as text_models  # noqa: E402
from madp.training.options import TrainOptions  # noqa: E402
from madp.training.outputs import evaluation_of  # noqa: E402
from madp.training.preparation import tf_keras  # noqa: E402
from madp.training.tasks import CausalLmTask  # noqa: E402
from madp.training.trainer import tf, train  # noqa: E402

pytestmark = [pytest.mark.tf]
SMOLLM2 = os.environ.get(
    "MADP_SMOLLM2", os.path.expanduser("~/.cache/madp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
)  # where `make pretrained` puts it
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's ids 0, 1 (BOS), 2 (EOS)
CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs there and then. "
    "They're here, it's there, we'll see what they've done. Numbers: 1234 and 56.\n"
)
VARIED = [
    "Hello, world!",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "They're sure it's fine; I'm not, we'll see, you've been, he'd go",
    "Grüße aus Köln, ça va? Ελληνικά, русский, 漢字かな交じり, emoji 🚀🎉 and ZWJ 👩‍👩‍👧",
    "digits 2024-11-25, 3.14159, ½ and ²",
    "<|endoftext|> is text here, not a special token",
    "x" * 50 + " " + "the " * 20,
]


# --- a tiny model as a GGUF file ----------------------------------------------------------------


def learn_merges(text: str, count: int, pre_tokenizer: str = "smollm") -> list[str]:
    """The `count` most frequent adjacent-symbol merges of a text's pre-tokenized pieces, in order."""
    splitter = bpe_tokenizer.BpeTokenizer([], [], 0, 0, 0, pre_tokenizer=pre_tokenizer)
    symbols = bpe_tokenizer.byte_symbols()
    words = collections.Counter(tuple(symbols[b] for b in piece.encode()) for piece in splitter.pieces(text))
    merges: list[str] = []
    for _ in range(count):
        pairs: collections.Counter = collections.Counter()
        for word, n in words.items():
            for pair in zip(word[:-1], word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        merges.append(f"{a} {b}")
        merged: collections.Counter = collections.Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def converter_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does to q_proj and k_proj rows."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_tiny_gguf(
    path: str,
    seed: int = 0,
    layers: int = 2,
    width: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    vocabulary: int = 300,
    tied: bool = True,
    architecture: str = "llama",
    metadata: Sequence[Callable[[dict], None]] = (),
    tensors: Callable[[str, np.ndarray], np.ndarray] = lambda name, values: values,
) -> str:
    """A random Llama of SmolLM2's layout (F32 tensors, the real file's names and metadata keys), whose
    BPE vocabulary is SmolLM2's special tokens, the 256 byte symbols and merges learned on CORPUS.
    Crafted ones: each of `metadata` edits the metadata ({key: gguf.GGUFValue}) before it is written,
    and `tensors(name, values)` gives each tensor's values."""
    rng = np.random.default_rng(seed)
    head_dim, hidden = width // heads, 3 * width

    def matrix(rows: int, columns: int) -> np.ndarray:  # [n_out, n_in]: PyTorch's Linear layout
        return rng.normal(0, 1 / math.sqrt(columns), (rows, columns)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.normal(size=width)).astype(np.float32)

    writer = tiny_gguf_metadata(path, layers, width, heads, kv_heads, vocabulary, architecture, hidden)
    for edit in metadata:
        edit(writer.kv_data[0])

    def add(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, tensors(name, values))

    add("token_embd.weight", rng.normal(0, 1, (vocabulary, width)).astype(np.float32))
    add("output_norm.weight", norm())
    if not tied:
        add("output.weight", matrix(vocabulary, width))
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", norm())
        add(f"blk.{i}.attn_q.weight", converter_permute(matrix(heads * head_dim, width), heads))
        add(f"blk.{i}.attn_k.weight", converter_permute(matrix(kv_heads * head_dim, width), kv_heads))
        add(f"blk.{i}.attn_v.weight", matrix(kv_heads * head_dim, width))
        add(f"blk.{i}.attn_output.weight", matrix(width, heads * head_dim))
        add(f"blk.{i}.ffn_norm.weight", norm())
        add(f"blk.{i}.ffn_gate.weight", matrix(hidden, width))
        add(f"blk.{i}.ffn_up.weight", matrix(hidden, width))
        add(f"blk.{i}.ffn_down.weight", matrix(width, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gguf_metadata(
    path: str, layers: int, width: int, heads: int, kv_heads: int, vocabulary: int, architecture: str, hidden: int
):
    """A GGUFWriter holding the metadata of `write_tiny_gguf`'s model."""
    merges = learn_merges(CORPUS, vocabulary - len(SPECIAL) - 256)
    tokens = [*SPECIAL, *bpe_tokenizer.byte_symbols(), *(m.replace(" ", "") for m in merges)]
    assert len(tokens) == vocabulary and len(set(tokens)) == vocabulary
    head_dim = width // heads
    writer = gguf.GGUFWriter(path, architecture)
    arch = architecture
    writer.add_uint32(f"{arch}.block_count", layers)
    writer.add_uint32(f"{arch}.context_length", 64)
    writer.add_uint32(f"{arch}.embedding_length", width)
    writer.add_uint32(f"{arch}.feed_forward_length", hidden)
    writer.add_uint32(f"{arch}.attention.head_count", heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32(f"{arch}.vocab_size", vocabulary)
    writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf_file.CONTROL_TOKEN] * len(SPECIAL) + [1] * (vocabulary - len(SPECIAL)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    return writer


def write_aliased_gguf(path: str, layers: int, width: int = 4096, heads: int = 32, kv_heads: int = 8) -> str:
    """A crafted GGUF file of a model far larger than its bytes: every tensor of `write_tiny_gguf`'s
    layout (a feed-forward width of `width`) is stated as Q4_0 data at the same place, the start of one
    block of zero bytes as large as the largest of them; GGUF does not forbid tensors sharing bytes."""
    writer = tiny_gguf_metadata(path, layers, width, heads, kv_heads, 300, "llama", width)
    q4, (block, size) = gguf.GGMLQuantizationType.Q4_0, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_0]
    queries, keys = (width, width), (kv_heads * width // heads, width)
    shapes = {"token_embd.weight": (300, width), "output_norm.weight": (width,)}
    for i in range(layers):
        for name, shape in (("attn_norm", (width,)), ("ffn_norm", (width,)), ("attn_q", queries), ("attn_k", keys),
                            ("attn_v", keys), ("attn_output", queries), ("ffn_gate", queries), ("ffn_up", queries),
                            ("ffn_down", queries)):  # fmt: skip
            shapes[f"blk.{i}.{name}.weight"] = shape
    for name, shape in shapes.items():  # none has bytes of its own: each starts where the zeros do
        writer.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), 0, raw_dtype=q4)
        writer.tensors[0][name].tensor = np.empty(0, np.uint8)
    writer.add_tensor("zeros", np.zeros(width * width // block * size, np.uint8), raw_dtype=q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def reference_logits(path: str, ids: np.ndarray) -> np.ndarray:
    """Next-token logits [T, V] of one sequence, in float64 numpy straight from the GGUF tensors, as
    llama.cpp computes them: RoPE rotates adjacent pairs (2i, 2i+1) of the permuted Q and K rows."""
    reader = gguf.GGUFReader(path)

    def field(key: str):
        return reader.fields[key].contents()

    tensors = {  # a quantized tensor's data are its blocks' bytes: dequantized by gguf's own code
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(t.shape.tolist()[::-1])
        for t in reader.tensors
    }
    heads, kv_heads = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    width, eps = field("llama.embedding_length"), field("llama.attention.layer_norm_rms_epsilon")
    base = field("llama.rope.freq_base")
    head_dim, length = width // heads, len(ids)

    def rms(x, weight):
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * weight

    def rope(x):  # [T, heads, head_dim]
        angles = np.arange(length)[:, None] * base ** (-np.arange(0, head_dim, 2) / head_dim)[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
        return out

    x = tensors["token_embd.weight"][ids]
    for i in range(field("llama.block_count")):
        t = {name.split(".", 2)[2]: value for name, value in tensors.items() if name.startswith(f"blk.{i}.")}
        h = rms(x, t["attn_norm.weight"])
        q = rope((h @ t["attn_q.weight"].T).reshape(length, heads, head_dim))
        k = rope((h @ t["attn_k.weight"].T).reshape(length, kv_heads, head_dim))
        v = (h @ t["attn_v.weight"].T).reshape(length, kv_heads, head_dim)
        attended = np.zeros((length, heads, head_dim))
        for head in range(heads):
            shared = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, shared].T / math.sqrt(head_dim)
            scores[np.triu_indices(length, 1)] = -np.inf
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            attended[:, head] = (weights / weights.sum(axis=1, keepdims=True)) @ v[:, shared]
        x = x + attended.reshape(length, width) @ t["attn_output.weight"].T
        h = rms(x, t["ffn_norm.weight"])
        gate = h @ t["ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ t["ffn_up.weight"].T)) @ t["ffn_down.weight"].T
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    return rms(x, tensors["output_norm.weight"]) @ head.T


# --- the tokenizer ------------------------------------------------------------------------------


def test_tokenizer_round_trips_varied_text_and_merges_learned_words(tiny):
    tokenizer = pretrained.read_pretrained(tiny).tokenizer
    for text in VARIED:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text, text
        assert all(0 <= i < len(tokenizer) for i in ids)
        assert tokenizer.encode(text, limit=5) == ids[:5]
    the = tokenizer.encode(" the")
    assert len(the) == 1 and tokenizer.tokens[the[0]] == "Ġthe"  # the corpus's most frequent word
    words = ("The", "Ġfox", "Ġsleeps", "Ġand", "Ġthe", "Ġdog", "Ġruns")  # each learned as one token
    assert tokenizer.encode("The fox sleeps and the dog runs") == [tokenizer.ids[t] for t in words]
    assert (tokenizer.bos, tokenizer.eos, tokenizer.pad) == (1, 2, 2)
    assert tokenizer.decode([1, *tokenizer.encode("hi"), 2]) == "hi"  # control tokens are left out


def test_pretokenization_is_gpt2s_with_digits_apart():
    tokenizer = bpe_tokenizer.BpeTokenizer([], [], 0, 0, 0, pre_tokenizer="smollm")
    pieces = list(tokenizer.pieces("I'm 2024's best!!  ok\n\nYes  x 漢字 ½"))
    assert pieces == ["I", "'m", " ", "2", "0", "2", "4", "'s", " best", "!!", " ", " ok", "\n", "\n", "Yes"] + [
        " ",
        " x",
        " 漢字",
        " ",
        "½",
    ]
    gpt2 = bpe_tokenizer.BpeTokenizer([], [], 0, 0, 0, pre_tokenizer="gpt2")
    assert list(gpt2.pieces("in 2024!")) == ["in", " 2024", "!"]
    llama3 = bpe_tokenizer.BpeTokenizer([], [], 0, 0, 0, pre_tokenizer="llama-bpe")  # numbers by threes, any case
    assert list(llama3.pieces("I'M in 1234567!\n\n  (x)")) == ["I", "'M", " in", " ", "123", "456", "7", "!\n\n"] + [
        " ",
        " (",
        "x",
        ")",
    ]


# Pieces of what texts hold: words in several scripts, numbers, contractions, symbols, emoji, whitespace
PIECES = [
    *"abcdefghijklmnopqrstuvwxyzTHE",
    "the", "fox", "Grüße", "ça", "naïve", "Ελληνικά", "русский", "漢字", "かな", "ÿ", "İ",
    *"0123456789", "2024", "½", "²", "٣", "Ⅻ",
    "'", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL",
    *".,;:!?-()[]{}<>@#$%^&*_+=/\\|~`\"", "...", "--", "🚀", "👩\u200d👧", "\x00", "\x1f",
    " ", " ", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\xa0", "\u2028", "\u3000", "   \n",
]  # fmt: skip


def ordinary_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [*VARIED, CORPUS, *("".join(rng.choices(PIECES, k=rng.randint(1, 60))) for _ in range(count))]


def symbol_tokens(merges: list[str]) -> list[str]:
    """A vocabulary that holds the byte symbols and every merge's result."""
    merged = [merge.replace(" ", "") for merge in merges]
    return list(dict.fromkeys([*SPECIAL, *bpe_tokenizer.byte_symbols(), *merged]))


@pytest.mark.parametrize("pre_tokenizer", bpe_tokenizer.PRE_TOKENIZERS)
def test_tokens_of_ordinary_text_are_gpt2s_byte_level_bpe(pre_tokenizer):
    """On text without a run of more than RUN letters, numbers, symbols or whitespace, the tokens are
    those of the reference (tests/reference.py): the pre-tokenizers' own regexes, runs of any length,
    and GPT-2's merge loop, which scans every pair for each merge."""
    assert gpt2_byte_symbols() == list(bpe_tokenizer.byte_symbols())
    texts = ordinary_texts(400, seed=5)
    merges = learn_merges("".join(texts[:200]), 400, pre_tokenizer)
    tokenizer = bpe_tokenizer.BpeTokenizer(symbol_tokens(merges), merges, 1, 2, 2, pre_tokenizer=pre_tokenizer)
    for text in texts:
        ids = tokenizer.encode(text)
        assert [tokenizer.tokens[i] for i in ids] == reference_bpe_tokens(text, merges, pre_tokenizer), repr(text)
        assert tokenizer.encode(text.encode("utf-8"), limit=7) == ids[:7]


def test_bytes_text_never_holds_may_lack_a_symbol_and_are_dropped():
    """A vocabulary without the symbols of control bytes (SmolLM2's lacks 21 such bytes) loads, and its
    tokenizer drops those bytes from a text, as Hugging Face's and llama.cpp's do; a vocabulary without
    a byte that text holds (',') is refused."""
    symbols = bpe_tokenizer.byte_symbols()
    vocabulary = [token for token in symbol_tokens([]) if token not in (symbols[0x04], symbols[0xFF])]
    refused = []
    bpe_tokenizer.check_vocabulary(set(vocabulary), [], refused.append, "tokens", "merge")
    assert not refused and {0x04, 0xFF, 0xC0} <= set(range(256)) - bpe_tokenizer.text_bytes()
    tokenizer = bpe_tokenizer.BpeTokenizer(vocabulary, [], 1, 2, 2, pre_tokenizer="gpt2")
    assert tokenizer.decode(tokenizer.encode("a\x04b, c\n")) == "ab, c\n"
    with pytest.raises(InputError, match="lacks the symbols of 1 bytes \\(e.g. ','\\)"):
        bpe_tokenizer.check_vocabulary(set(vocabulary) - {","}, [], InputError, "tokens", "merge")


def test_merges_follow_gpt2s_rule_whatever_their_order():
    """Merge tables in random orders (a merge before the ones that make its parts, too): the merges the
    heap finds are GPT-2's, the lowest rank at every place left to right, then again."""
    rng = random.Random(11)
    for _ in range(40):
        pool, merges = ["a", "b", "c", "Ġ"], []
        for _ in range(30):
            first, second = rng.choice(pool), rng.choice(pool)
            merges.append(f"{first} {second}")
            pool.append(first + second)
        rng.shuffle(merges)
        merges = list(dict.fromkeys(merges))
        tokenizer = bpe_tokenizer.BpeTokenizer(symbol_tokens(merges), merges, 1, 2, 2, pre_tokenizer="gpt2")
        for _ in range(20):
            text = "".join(rng.choices("abc ", k=rng.randint(1, 40)))
            expected = reference_bpe_tokens(text, merges, "gpt2")
            assert [tokenizer.tokens[i] for i in tokenizer.encode(text)] == expected, (text, merges)


def test_a_run_of_more_than_256_characters_is_pretokenized_in_runs():
    for pre_tokenizer in bpe_tokenizer.PRE_TOKENIZERS:
        tokenizer = bpe_tokenizer.BpeTokenizer([], [], 0, 0, 0, pre_tokenizer=pre_tokenizer)
        run = 256  # bpe_tokenizer.RUN, as docs/how-to/text-models.md gives it
        assert [len(p) for p in tokenizer.pieces("a" * (2 * run + 10))] == [run, run, 10]
        assert [len(p) for p in tokenizer.pieces(" " + "." * (run + 1))] == [run + 1, 1]
        assert max(len(p) for p in tokenizer.pieces(" " * 3 * run + "\n" * 3 * run + "x")) <= 2 * run + 1


def test_megabytes_of_extra_text_cost_the_tokenizer_no_more_work(tiny, monkeypatch):
    """A text that continues for megabytes costs what a text of --max-length tokens costs: the
    tokenizer reads only the prefix those tokens can come from (its memory does not grow with the
    rest), merges the same symbols, and gives the same tokens, whether the rest is 1 MB or 4 MB."""
    merged: list[int] = []
    original = bpe_tokenizer.BpeTokenizer._merged
    monkeypatch.setattr(
        bpe_tokenizer.BpeTokenizer, "_merged", lambda self, parts: merged.append(len(parts)) or original(self, parts)
    )
    head = CORPUS.encode()[:20]

    def work(text: bytes) -> tuple[list[int], int, int]:
        tokenizer = pretrained.read_pretrained(tiny).tokenizer  # an empty cache of pieces
        merged.clear()
        tracemalloc.start()
        try:
            _, targets = bpe_tokenizer.token_sequences(tokenizer, [text], 64)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return targets[0].tolist(), sum(merged), peak

    for rest in (b"x", b" the fox", b" ", b"7", b"!", b"\n"):
        tokens, symbols, peak = work(head + rest * (1_000_000 // len(rest)))
        assert work(head + rest * (4_000_000 // len(rest))) == (tokens, symbols, peak), rest
        assert peak < 500_000 and symbols <= len(head) + 64 * 4 * (2 * bpe_tokenizer.RUN + 1), rest
        assert -1 not in tokens  # the 64 tokens, from the head and the start of the rest


def test_token_sequences_start_with_bos_and_mark_the_end():
    tokenizer = bpe_tokenizer.BpeTokenizer(
        [*SPECIAL, *bpe_tokenizer.byte_symbols()], [], bos=1, eos=2, pad=2, pre_tokenizer="smollm"
    )
    x, y = bpe_tokenizer.token_sequences(tokenizer, [b"ab", b"abcdef"], 4)
    a, b, c = (tokenizer.ids[s] for s in "abc")
    assert y.tolist() == [[a, b, -1, -1], [a, b, c, tokenizer.ids["d"]]]
    assert x.tolist() == [[1, a, b, 2], [1, a, b, c]]


# --- the model ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_keras_llama_matches_an_independent_numpy_forward_pass(tmp_path, tied):
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"), seed=3, tied=tied)
    loaded = pretrained.read_pretrained(path)
    assert loaded.config.tied_output is tied and loaded.config.kv_heads == 2 and loaded.config.head_dim == 8
    model = pretrained.pretrained_model(loaded)
    ids = np.random.default_rng(0).integers(0, 300, (3, 11)).astype(np.int32)
    logits = np.asarray(model(ids))
    assert logits.shape == (3, 11, 300) and np.abs(logits).max() > 1  # not a near-zero output
    for row in range(3):
        np.testing.assert_allclose(logits[row], reference_logits(path, ids[row]), atol=1e-5, rtol=1e-5)


def test_the_match_depends_on_undoing_the_converters_permutation(tiny, monkeypatch):
    """Without `_unpermute`, the half-rotating model is a different model: the check above can fail."""
    ids = np.arange(20, 36, dtype=np.int32)[None]
    monkeypatch.setattr(gguf_file, "_unpermute", lambda weight, heads: weight)
    wrong = np.asarray(pretrained.pretrained_model(pretrained.read_pretrained(tiny))(ids))[0]
    assert np.abs(wrong - reference_logits(tiny, ids[0])).max() > 1e-2


def test_causal_attention_ignores_later_tokens(tiny):
    model = pretrained.pretrained_model(pretrained.read_pretrained(tiny))
    ids = np.random.default_rng(1).integers(0, 300, (1, 12)).astype(np.int32)
    changed = ids.copy()
    changed[0, 8:] = 7
    np.testing.assert_allclose(np.asarray(model(ids))[0, :8], np.asarray(model(changed))[0, :8], atol=1e-5)


# --- keras-hub presets ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, layers, tied", [("keras_hub_llama", 2, True), ("keras_hub_llama3", 11, False)])
def test_a_keras_hub_preset_computes_what_keras_hub_computes(name, layers, tied):
    """keras-hub wrote these presets, and beside them its logits for fixed ids and its token ids for
    test strings (tests/data/make_keras_hub_presets.py); madp reads them without keras-hub."""
    path = os.path.join(DATA, name)
    expected = json.load(open(os.path.join(path, "expected.json"), encoding="utf-8"))
    loaded = pretrained.read_pretrained(path)
    assert (loaded.config.layers, loaded.config.tied_output, loaded.config.context_length) == (layers, tied, None)
    logits = np.asarray(pretrained.pretrained_model(loaded)(np.array(expected["token_ids"], np.int32)))
    np.testing.assert_allclose(logits, np.array(expected["logits"]), atol=1e-4)
    tokenizer = loaded.tokenizer
    assert [tokenizer.encode(text) for text in expected["strings"]] == expected["encoded"]
    assert (tokenizer.bos, tokenizer.eos) == (expected["bos"], expected["eos"])
    for text in expected["strings"]:
        assert tokenizer.decode([tokenizer.bos, *tokenizer.encode(text), tokenizer.eos]) == text


def copied_preset(tmp_path, name: str, edit=None, remove: str | None = None) -> str:
    """The tied fixture preset copied to tmp_path/name, with a JSON file edited ((file, change)) or a
    file removed."""
    import shutil

    path = tmp_path / name
    shutil.copytree(os.path.join(DATA, "keras_hub_llama"), path)
    if edit:
        file, change = edit
        value = json.load(open(path / file))
        change(value)
        json.dump(value, open(path / file, "w"))
    if remove:
        os.remove(path / remove)
    return str(path)


def rewrite_weights(path: str, change) -> None:
    """Apply change(store, name, values) to every dataset of a preset's model.weights.h5."""
    import h5py

    with h5py.File(os.path.join(path, "model.weights.h5"), "r+") as store:
        names: list[str] = []
        store.visititems(lambda name, item: names.append(name) if isinstance(item, h5py.Dataset) else None)
        for name in names:
            values = np.asarray(store[name])
            del store[name]
            change(store, name, values)


def test_a_bfloat16_preset_reads_as_its_rounded_weights(tmp_path):
    """Keras 3 saves bfloat16 weights as 2-byte opaque data marked dtype "bfloat16"."""
    import ml_dtypes

    path = copied_preset(tmp_path, "bf16")
    original = pretrained.read_pretrained(path).layer_weights()

    def to_bfloat16(store, name, values):
        store.create_dataset(name, data=values.astype(ml_dtypes.bfloat16)).attrs["dtype"] = "bfloat16"

    rewrite_weights(path, to_bfloat16)
    for name, values in pretrained.read_pretrained(path).layer_weights().items():
        rounded = original[name][0].astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(values[0], rounded, err_msg=name)
    integers = copied_preset(tmp_path, "integers")
    rewrite_weights(integers, lambda store, name, values: store.create_dataset(name, data=values.astype(np.int32)))
    with pytest.raises(InputError, match="int32 data, not floating point"):
        pretrained.read_pretrained(integers).layer_weights()


def test_bad_keras_hub_presets_are_clear_errors(tmp_path):
    def preset(name: str, edit=None, remove: str | None = None) -> str:
        return copied_preset(tmp_path, name, edit, remove)

    with pytest.raises(InputError, match="a directory without config.json \\(not a keras-hub preset\\)"):
        pretrained.read_pretrained(str(tmp_path))
    gemma = preset("gemma", ("config.json", lambda c: c.update(class_name="GemmaBackbone")))
    with pytest.raises(InputError, match="a 'GemmaBackbone' preset; madp reads the keras-hub backbones"):
        pretrained.read_pretrained(gemma)
    scaled = preset("scaled", ("config.json", lambda c: c["config"].update(rope_frequency_adjustment_factor=8.0)))
    with pytest.raises(InputError, match="RoPE scaling .* is not implemented"):
        pretrained.read_pretrained(scaled)
    for name, change, message in (
        ("null", lambda c: c.update(config=None), "config.json has no backbone configuration"),
        ("headless", lambda c: c["config"].update(num_query_heads=0), "num_query_heads is 0, not a positive whole"),
        ("fraction", lambda c: c["config"].update(num_layers=2.5), "num_layers is 2.5, not a positive whole number"),
        ("rope", lambda c: c["config"].update(rope_max_wavelength=-1), "rope_max_wavelength is -1, not a positive fin"),
        ("deeper", lambda c: c["config"].update(num_layers=3), "holds 2 decoder blocks, config.json says 3"),
        (
            "small",
            lambda c: c["config"].update(vocabulary_size=100),
            "has shape \\(301, 16\\), config.json says \\(100",
        ),
    ):
        with pytest.raises(InputError, match=message):
            pretrained.read_pretrained(preset(name, ("config.json", change)))
    vocabulary = "assets/tokenizer/vocabulary.json"
    for name, change, message in (
        ("twice", lambda v: v.update({"Ġ": 0}), "gives two tokens the same id"),
        ("byteless", lambda v: v.pop("Ġ"), "lacks the symbols of 1 bytes"),
        ("beyond", lambda v: v.update({"zz": 400}), "ids must be whole numbers in \\[0, 301\\)"),
    ):
        with pytest.raises(InputError, match=message):
            pretrained.read_pretrained(preset(name, (vocabulary, change)))
    malformed = preset("malformed")
    with open(os.path.join(malformed, "assets/tokenizer/merges.txt"), "a") as merges:
        merges.write("a b c\n")
    with pytest.raises(InputError, match="merges.txt line 41 \\('a b c'\\) is not two tokens"):
        pretrained.read_pretrained(malformed)
    spm = preset("spm", ("tokenizer.json", lambda c: c.update(class_name="LlamaTokenizer")))
    with pytest.raises(InputError, match="a 'LlamaTokenizer' tokenizer; madp reads keras-hub's Llama3Tokenizer"):
        pretrained.read_pretrained(spm)
    with pytest.raises(InputError, match="no model.weights.h5"):
        pretrained.read_pretrained(preset("sharded", remove="model.weights.h5"))
    with pytest.raises(InputError, match="assets/tokenizer: unreadable \\(FileNotFoundError"):
        pretrained.read_pretrained(preset("no-merges", remove="assets/tokenizer/merges.txt"))
    wider = preset("wider", ("config.json", lambda c: c["config"].update(intermediate_dim=32)))
    with pytest.raises(InputError, match="_feedforward_gate_dense/vars/0 has shape \\(16, 24\\), expected \\(16, 32"):
        pretrained.pretrained_model(pretrained.read_pretrained(wider))
    transposed = preset("transposed")
    rewrite_weights(transposed, lambda store, name, values: store.create_dataset(name, data=values.T))
    with pytest.raises(InputError, match="has shape \\(16, 301\\), config.json says \\(301, 16\\)"):
        pretrained.read_pretrained(transposed)
    (tmp_path / "not-h5").mkdir()
    for file in ("config.json", "tokenizer.json"):
        (tmp_path / "not-h5" / file).write_text(open(os.path.join(DATA, "keras_hub_llama", file)).read())
    (tmp_path / "not-h5" / "model.weights.h5").write_text("not HDF5")
    with pytest.raises(InputError, match="model.weights.h5 is not a readable HDF5 file"):
        pretrained.read_pretrained(str(tmp_path / "not-h5"))


# --- training -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_batches(tmp_path_factory):
    """Generated documents bounded (k = 2) and batched (4 steps of 8 expected rows; also with min-sep 2
    for BandMF); held-out records."""
    directory = tmp_path_factory.mktemp("causal-lm")
    table = to_table(generate(GraphSpec(records=400, task="text", seed=5)))
    held_out = np.arange(len(table)) % 20 == 0
    data, evaluation = str(directory / "records.parquet"), str(directory / "test.parquet")
    pq.write_table(table.filter(pa.array(~held_out)), data)
    pq.write_table(table.filter(pa.array(held_out)), evaluation)
    bound_local(data, str(directory / "bounded"), BoundOptions(max_contributions=2))
    batch_local(
        str(directory / "bounded"), data, str(directory / "batches"), BatchOptions(seed=0, steps=4, batch_size=8)
    )
    options = BatchOptions(seed=0, steps=4, batch_size=8, min_sep=2)  # BandMF with 2 bands
    batch_local(str(directory / "bounded"), data, str(directory / "minsep"), options)
    batch_local(str(directory / "bounded"), data, str(directory / "minsep-amplified"), options)
    return directory, str(directory / "batches"), evaluation


@pytest.mark.parametrize("mechanism", ["none", "dpsgd", "bandmf", "bandmf-minsep"])
def test_causal_lm_trains_without_and_with_dpsgd_and_bandmf(text_batches, tiny, mechanism):
    directory, batches, evaluation = text_batches
    private = {} if mechanism == "none" else {"noise_multiplier": 0.5, "noise_seed": 1}
    if mechanism == "bandmf":
        batches, private = str(directory / "minsep"), {**private, "bands": 2}
    if mechanism == "bandmf-minsep":  # BandMF amplified by b-min-sep sampling, accounted by Monte Carlo
        batches, private = str(directory / "minsep-amplified"), {"epsilon": 8.0, "bands": 2, "amplified": True}
    options = TrainOptions(
        model="causal-lm",
        pretrained=tiny,
        mechanism="bandmf" if mechanism == "bandmf-minsep" else mechanism,
        max_length=16,
        learning_rate=1e-3,
        eval_data=evaluation,
        eval_every=2,
        **private,
    )
    out = directory / f"trained-{mechanism}"
    result = train(batches, str(out), options)
    assert result.privacy["mechanism"] == mechanism
    evaluated = evaluation_of(str(out), internal=True)
    final = evaluated["final"]
    assert final["tokens"] > 100 and math.isfinite(final["loss"])
    assert final["perplexity"] == pytest.approx(math.exp(final["loss"]), rel=1e-4)
    assert [e["step"] for e in evaluated["eval"]] == [2, 4]
    saved = tf_keras.models.load_model(str(out / "model.keras"), compile=False)
    ids = np.arange(3, 19, dtype=np.int32)[None]
    trained = pretrained.llama_model(pretrained.read_pretrained(tiny).config, 16)
    trained.set_weights(saved.get_weights())
    np.testing.assert_allclose(np.asarray(saved(ids)), np.asarray(trained(ids)), atol=1e-5)
    metrics = json.load(open(out / "metrics.json"))
    assert metrics["model"] == "causal-lm" and metrics["lora_rank"] == 0
    assert "pretrained_eval" not in metrics, "an evaluation on data not declared public is internal"
    before = evaluation_of(str(out), internal=True)["pretrained_eval"]
    assert before["tokens"] == final["tokens"] and before != final


# --- LoRA adapters ------------------------------------------------------------------------------


def test_lora_starts_as_the_pretrained_model_and_its_adapters_are_ghost_clipped(tiny):
    from madp.training.clipping import per_example_gradients
    from madp.training.ghost_clipping import ghost_norms, unsupported_layers

    loaded = pretrained.read_pretrained(tiny)
    full, lora = pretrained.pretrained_model(loaded, 12), pretrained.pretrained_model(loaded, 12, lora_rank=2)
    ids = np.random.default_rng(0).integers(0, 300, (4, 12)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(full(ids)), np.asarray(lora(ids)))  # B = 0: x W + x A 0
    names = sorted(v.name.split("/", 1)[1] for v in lora.trainable_variables)
    # two blocks, adapters on the query and value projections only
    assert names == ["lora_a/kernel:0"] * 4 + ["lora_b/kernel:0"] * 4
    assert {v.name.split("/")[0] for v in lora.trainable_variables} == {"blk_0_attn_q", "blk_0_attn_v",
                                                                         "blk_1_attn_q", "blk_1_attn_v"}  # fmt: skip
    assert unsupported_layers(lora) == [] == unsupported_layers(full)
    rng = np.random.default_rng(1)
    for variable in lora.trainable_variables:  # B != 0, so A's gradients are not zero
        variable.assign(rng.normal(0, 0.1, variable.shape).astype(np.float32))
    targets = np.concatenate([ids[:, 1:], np.full((4, 1), -1, np.int32)], axis=1)
    weight = np.array([1, 1, 0.5, 0], np.float32)
    ghost = np.asarray(ghost_norms(lora, pretrained.next_token_loss, ids, targets, weight))
    each = per_example_gradients(lora, pretrained.next_token_loss, ids, targets, weight)
    reference = np.sqrt(sum((np.asarray(g).reshape(4, -1) ** 2).sum(axis=1) for g in each))
    assert reference[0] > 0.1 and reference[3] == 0
    np.testing.assert_allclose(ghost, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_every_weight_is_ghost_clipped_as_per_example_gradients_clip_it(tmp_path, tied):
    """Fine-tuning every weight: RMSNorm scales and the token embedding, tied (looked up and the LM
    head, its two gradients summed before the norm) or not, clipped without per-example gradients,
    equal to per-example gradients clipped one by one (padding rows and repeated tokens included)."""
    from madp.training.clipping import per_example_gradients
    from madp.training.ghost_clipping import ghost_clipped_sum, ghost_norms

    path = write_tiny_gguf(str(tmp_path / "model.gguf"), tied=tied)
    model = pretrained.pretrained_model(pretrained.read_pretrained(path), 10)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 40, (5, 10)).astype(np.int32)  # 40 of the 300 ids: repeats within a row
    targets = np.concatenate([ids[:, 1:], np.full((5, 1), -1, np.int32)], axis=1)
    weight = np.array([1, 0, 0.5, 1, 2], np.float32)
    each = [np.asarray(g) for g in per_example_gradients(model, pretrained.next_token_loss, ids, targets, weight)]
    norms = np.sqrt(sum((g.reshape(5, -1) ** 2).sum(axis=1) for g in each))
    assert norms[1] == 0 and (norms[[0, 2, 3, 4]] > 0).all()
    ghost = ghost_norms(model, pretrained.next_token_loss, ids, targets, weight)
    np.testing.assert_allclose(np.asarray(ghost), norms, rtol=1e-4)
    clip = float(np.median(norms[norms > 0]))
    factor = np.minimum(1.0, clip / np.maximum(norms, 1e-30))
    summed = ghost_clipped_sum(model, pretrained.next_token_loss, ids, targets, weight, clip)
    names = [v.name for v in model.trainable_variables]
    assert any("token_embd" in n for n in names) and any("norm" in n for n in names)
    for got, g, name in zip(summed, each, names, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.tensordot(factor, g, 1), rtol=1e-4, atol=1e-5, err_msg=name)


def test_lora_trains_the_adapters_only_and_saves_them(text_batches, tiny):
    directory, batches, evaluation = text_batches
    options = TrainOptions(model="causal-lm", pretrained=tiny, lora_rank=2, max_length=16, eval_data=evaluation,
                           eval_every=4, noise_multiplier=0.5, noise_seed=1)  # fmt: skip
    out = directory / "trained-lora"
    result = train(batches, str(out), options)
    settings = result.metrics.settings
    assert settings["lora_rank"] == 2 and settings["learning_rate"] == 2e-3  # LoRA's default rate
    saved = tf_keras.models.load_model(str(out / "model.keras"), compile=False)
    start = pretrained.pretrained_model(pretrained.read_pretrained(tiny), 16, lora_rank=2)
    for before, after in zip(start.weights, saved.weights, strict=True):
        changed = not np.array_equal(np.asarray(before), np.asarray(after))
        assert changed == ("lora" in before.name), before.name  # the pretrained weights stay as they were
    ids = np.arange(3, 19, dtype=np.int32)[None]
    start.set_weights(saved.get_weights())
    np.testing.assert_allclose(np.asarray(saved(ids)), np.asarray(start(ids)), atol=1e-6)
    with pytest.raises(InputError, match="^lora_rank must be at least 0, and above 0 only with model causal-lm"):
        TrainOptions(model="text-lm", mechanism="none", lora_rank=4)


def test_the_task_evaluates_the_pretrained_model_before_training(text_batches, tiny):
    _, _, evaluation = text_batches
    schema = {"text": Feature("text", "bytes", ())}
    task = CausalLmTask(TrainOptions(model="causal-lm", pretrained=tiny, mechanism="none", max_length=16), schema)
    model, loss = task.build()
    data = task.read_eval(evaluation)
    assert task.pretrained_eval == task.evaluate(model, loss, data)
    # a random model over 300 tokens: about ln(300) = 5.7 nats, give or take its random logits' scale
    assert 3 < task.pretrained_eval["loss"] < 30 and task.pretrained_eval["tokens"] == (data[1] >= 0).sum()


def test_bad_pretrained_inputs_are_clear_errors(tmp_path, tiny):
    with pytest.raises(InputError, match="no such file"):
        pretrained.read_pretrained(str(tmp_path / "missing.gguf"))
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(InputError, match="not a GGUF file"):
        pretrained.read_pretrained(str(tmp_path / "text.gguf"))
    (tmp_path / "short.gguf").write_bytes(open(tiny, "rb").read()[:100])
    with pytest.raises(InputError, match="unreadable GGUF file"):
        pretrained.read_pretrained(str(tmp_path / "short.gguf"))
    other = write_tiny_gguf(str(tmp_path / "gpt2.gguf"), architecture="gpt2")
    with pytest.raises(InputError, match="a 'gpt2' model; madp implements the 'llama' architecture only"):
        pretrained.read_pretrained(other)
    schema = {"text": Feature("text", "bytes", ())}
    too_long = TrainOptions(model="causal-lm", pretrained=tiny, mechanism="none", max_length=65)
    with pytest.raises(
        InputError, match="max_length 65 exceeds the context length of pretrained \\(64 tokens"
    ) as refused:
        CausalLmTask(too_long, schema)
    assert error_text(refused.value).startswith("--max-length 65 exceeds the context length of --pretrained (64")
    with pytest.raises(InputError, match="^model causal-lm needs pretrained"):
        TrainOptions(model="causal-lm", mechanism="none")
    with pytest.raises(InputError, match="pretrained needs model causal-lm"):
        TrainOptions(model="text-lm", mechanism="none", pretrained=tiny)


# --- crafted files ------------------------------------------------------------------------------


def set_metadata(key: str, value, kind: gguf.GGUFValueType = gguf.GGUFValueType.UINT32) -> Callable[[dict], None]:
    """A metadata edit of `write_tiny_gguf`: `key` set to `value` of type `kind`, or removed (None)."""

    def edit(metadata: dict) -> None:
        if value is None:
            del metadata[key]
        else:
            metadata[key] = gguf.GGUFValue(value, kind)

    return edit


def renamed_token(token: str, name: str) -> Callable[[dict], None]:
    """A metadata edit of `write_tiny_gguf`: a token of the vocabulary renamed (the vocabulary keeps its size)."""

    def edit(metadata: dict) -> None:
        tokens = metadata["tokenizer.ggml.tokens"].value
        tokens[tokens.index(token)] = name

    return edit


def one_nan(tensor: str) -> Callable[[str, np.ndarray], np.ndarray]:
    """A tensor edit of `write_tiny_gguf`: one value of `tensor` NaN."""

    def edit(name: str, values: np.ndarray) -> np.ndarray:
        if name == tensor:
            values = values.copy()
            values.flat[5] = np.nan
        return values

    return edit


CRAFTED = {  # how a file is crafted, and the error that names what is wrong
    "100000 blocks": (
        {"metadata": [set_metadata("llama.block_count", 100000)]},
        r"llama.block_count is 100000, but the file holds the tensors of 2 blocks \(blocks \[0, 1\]\)",
    ),
    "a huge width": (
        {"metadata": [set_metadata("llama.embedding_length", 2**30), set_metadata("llama.rope.dimension_count", None)]},
        r"tensor 'token_embd.weight' has shape \(300, 32\), where the metadata gives \(300, 1073741824\): "
        r"llama.vocab_size \(300\) x llama.embedding_length \(1073741824\)",
    ),
    "a huge feed-forward width": (
        {"metadata": [set_metadata("llama.feed_forward_length", 2**32 - 1)]},
        r"tensor 'blk.0.ffn_gate.weight' has shape \(96, 32\), where the metadata gives \(4294967295, 32\)",
    ),
    "a huge vocabulary": (
        {"metadata": [set_metadata("llama.vocab_size", 2**40, gguf.GGUFValueType.UINT64)]},
        "llama.vocab_size is 1099511627776, but tokenizer.ggml.tokens lists 300 tokens",
    ),
    "a string for an integer": (
        {"metadata": [set_metadata("llama.block_count", "two", gguf.GGUFValueType.STRING)]},
        r"llama.block_count is 'two' \(STRING\), not a whole number of at least 1",
    ),
    "no heads": (
        {"metadata": [set_metadata("llama.attention.head_count", 0)]},
        "llama.attention.head_count is 0, not a whole number of at least 1",
    ),
    "a BOS id past the vocabulary": (
        {"metadata": [set_metadata("tokenizer.ggml.bos_token_id", 300)]},
        r"tokenizer.ggml.bos_token_id is 300, not a token id \(tokenizer.ggml.tokens lists 300\)",
    ),
    "a merge missing from the vocabulary": (
        {"metadata": [renamed_token("he", "h-e")]},
        r"tokenizer.ggml.merges entry 1 \('h e'\) is not two tokens of the vocabulary whose merge is in it too",
    ),
    "a byte missing from the vocabulary": (
        {"metadata": [renamed_token(",", "comma")]},
        r"tokenizer.ggml.tokens lacks the symbols of 1 bytes \(e.g. ','\)",
    ),
    "a NaN weight": ({"tensors": one_nan("blk.1.ffn_down.weight")}, "tensor 'blk.1.ffn_down.weight' holds NaN"),
    "an integer tensor": (
        {"tensors": lambda name, values: values.astype(np.int32) if name == "output_norm.weight" else values},
        r"tensor 'output_norm.weight' cannot be read \(Dequantization for I32 is not yet implemented\)",
    ),
    "weights so large the loss overflows": (
        {"tensors": lambda name, values: values * 1e30 if name == "output_norm.weight" else values},
        r"the pretrained model's evaluation on --eval-data gives \{'perplexity': inf\}: the model's outputs or loss",
    ),
}


def train_causal_lm(batches: str, out: str, model: str, *flags: str) -> int:
    """`madp train BATCHES OUT --model causal-lm --pretrained MODEL` with DP-SGD, through the command line."""
    from madp.cli import main

    return main(["-q", "train", batches, out, "--model", "causal-lm", "--pretrained", model, "--max-length", "16",
                 "--noise-multiplier", "0.5", "--noise-seed", "1", *flags])  # fmt: skip


def assert_refused_before_writing(batches: str, out, train) -> str:
    """What `train()` wrote to stderr, once checked that it exited 2 without a traceback, wrote no
    model nor its files to OUT, and entered no training in the batches' ledger."""
    ledger = os.path.join(batches, "trainings.jsonl")
    before = open(ledger).read() if os.path.exists(ledger) else None
    code = train()
    assert not any(os.path.exists(os.path.join(out, name)) for name in ("model.keras", "metrics.json", "privacy.json"))
    assert (open(ledger).read() if os.path.exists(ledger) else None) == before
    return code


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_gguf_file_is_refused_by_name_before_anything_is_written(text_batches, tmp_path, capsys, case):
    """Each was a hang with growing memory (a model of the sizes the metadata states, built before its
    tensors were read), a traceback (an overflowing loss: math.exp's OverflowError on its perplexity),
    or (a NaN weight) exit 0 with a model trained on noise alone: DP-SGD's clipping gives every row no
    weight, and the evaluation file held NaN, which is not JSON."""
    _, batches, evaluation = text_batches
    crafted, message = CRAFTED[case]
    path = write_tiny_gguf(str(tmp_path / "crafted.gguf"), **crafted)
    out = str(tmp_path / "out")
    code = assert_refused_before_writing(
        batches, out, lambda: train_causal_lm(batches, out, path, "--eval-data", evaluation)
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert re.search(f"--pretrained {re.escape(path)}: {message}", err), err


def test_a_gguf_model_beyond_memory_is_refused_before_it_is_built(text_batches, tmp_path, capsys):
    """An 11 MB file of 1,000 blocks of width 4,096 whose tensors share their bytes: consistent metadata
    and tensors, 92 billion weights (was built until memory ran out)."""
    _, batches, _ = text_batches
    path = write_aliased_gguf(str(tmp_path / "aliased.gguf"), layers=1000)
    out = str(tmp_path / "out")
    assert assert_refused_before_writing(batches, out, lambda: train_causal_lm(batches, out, path)) == 2
    err = capsys.readouterr().err
    assert f"--pretrained {path}: its 92,284,112,896 weights in float32, with their copy read from the file, " in err
    assert re.search("hold about 688 GiB in memory, more than half of this machine's [0-9,]+ GiB", err), err


def array_metadata(key: str, values: list, kind: gguf.GGUFValueType) -> Callable[[dict], None]:
    """A metadata edit of `write_tiny_gguf`: `key` an array of `values` of type `kind`."""

    def edit(metadata: dict) -> None:
        metadata[key] = gguf.GGUFValue(values, gguf.GGUFValueType.ARRAY, sub_type=kind)

    return edit


def with_number(path: str, key: str, after: int, value: int) -> str:
    """A copy of the GGUF file `path` whose 64-bit number `after` bytes past metadata `key`'s name is
    `value` (an array's count is 8 bytes past it, after its value type and element type; its first
    string's length 16)."""
    data = bytearray(open(path, "rb").read())
    at = data.index(key.encode()) + len(key) + after
    data[at : at + 8] = value.to_bytes(8, "little")
    copy = f"{path[:-5]}-{key}-{after}.gguf"
    open(copy, "wb").write(data)
    return copy


def truncated(path: str, key: str, after: int) -> str:
    """A copy of the GGUF file `path` that ends `after` bytes past metadata `key`'s name."""
    data = open(path, "rb").read()
    copy = f"{path[:-5]}-{key}-cut.gguf"
    open(copy, "wb").write(data[: data.index(key.encode()) + len(key) + after])
    return copy


def nested_arrays(path: str, depth: int) -> str:
    """A GGUF file (version 3, no tensor) of one metadata entry, 'general.deep': arrays of one array each,
    `depth` deep, the innermost of one bool."""
    kinds = gguf.GGUFValueType
    arrays = struct.pack("<IQ", kinds.ARRAY, 1) * depth + struct.pack("<IQB", kinds.BOOL, 1, 1)
    key = b"general.deep"
    header = gguf.GGUF_MAGIC.to_bytes(4, "little") + struct.pack("<IQQQ", 3, 0, 1, len(key))
    open(path, "wb").write(header + key + struct.pack("<I", kinds.ARRAY) + arrays)
    return path


def test_gguf_metadata_that_would_hang_the_reader_is_refused_by_key_at_once(text_batches, tmp_path, capsys):
    """gguf's reader makes an object of every array element: a 16 MB file of one array of 2 million empty
    strings held it for half a minute and 3 GB (was read, then trained on); arrays of arrays 5000 deep
    raised its RecursionError. Counts and lengths are read first: an array of more than 65,536 elements
    outside the tokenizer's, a count or a length that runs past the file's end (a truncated file), and
    arrays nested more than 8 deep, are refused by key in milliseconds."""
    _, batches, _ = text_batches
    strings = [array_metadata("general.junk", [b""] * 200_000, gguf.GGUFValueType.STRING)]
    junk = write_tiny_gguf(str(tmp_path / "junk.gguf"), metadata=strings)
    out = str(tmp_path / "out")
    assert assert_refused_before_writing(batches, out, lambda: train_causal_lm(batches, out, junk)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"--pretrained {junk}: metadata 'general.junk', an array of 200,000 elements; madp reads at most " in err
    tiny = write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    # under the tokenizer's prefix, but none of its arrays: capped as any other key's
    strings = [array_metadata("tokenizer.ggml.junk", [b""] * 200_000, gguf.GGUFValueType.STRING)]
    tokenizer_junk = write_tiny_gguf(str(tmp_path / "tokenizer_junk.gguf"), metadata=strings)
    past_the_end = "past the end of its"
    for path, message in {
        junk: "metadata 'general.junk', an array of 200,000 elements; madp reads at most 65,536 in an array",
        tokenizer_junk: "metadata 'tokenizer.ggml.junk', an array of 200,000 elements; madp reads at most 65,536",
        with_number(junk, "general.junk", 8, 2**40): f"(metadata 'general.junk', an array of 1,099,511,627,776 "
        f"elements: {past_the_end}",
        with_number(tiny, "tokenizer.ggml.tokens", 16, 2**40): f"(metadata 'tokenizer.ggml.tokens', an array of "
        f"300 elements: {past_the_end}",
        with_number(tiny, "tokenizer.ggml.merges", 8, 2**61): "(metadata 'tokenizer.ggml.merges', an array of "
        f"2,305,843,009,213,693,952 elements: {past_the_end}",
        truncated(tiny, "tokenizer.ggml.tokens", 1000): f"(metadata 'tokenizer.ggml.tokens', an array of 300 elements: "
        f"{past_the_end}",
        nested_arrays(str(tmp_path / "deep.gguf"), 5000): "metadata 'general.deep' nests arrays more than 8 deep",
    }.items():
        start = time.perf_counter()
        with pytest.raises(InputError, match=re.escape(f"pretrained {path}: ") + ".*" + re.escape(message)):
            pretrained.read_pretrained(path)
        assert time.perf_counter() - start < 0.5, path


def test_the_tokenizers_arrays_are_refused_for_memory_only(text_batches, tmp_path, capsys, monkeypatch):
    """The tokenizer's arrays are as long as the vocabulary (Llama 3's 128k tokens, 280k merges): one of
    150,000 elements is read; under a memory limit that what the reader would hold passes, it is refused
    by key, before the reader runs."""
    from test_operational_faults import fake_cgroups

    _, batches, _ = text_batches
    scores = [array_metadata("tokenizer.ggml.scores", [0.0] * 150_000, gguf.GGUFValueType.FLOAT32)]
    path = write_tiny_gguf(str(tmp_path / "scores.gguf"), metadata=scores)
    assert pretrained.read_pretrained(path).config.vocabulary == 300
    limit_file = fake_cgroups(tmp_path, monkeypatch, 2, 256 << 20)
    out = str(tmp_path / "out")
    assert assert_refused_before_writing(batches, out, lambda: train_causal_lm(batches, out, path)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"--pretrained {path}: metadata 'tokenizer.ggml.scores', an array of 150,000 elements, read by the " in err
    assert f"MiB in memory, more than half of the 256 MiB memory limit of this process's cgroup ({limit_file})" in err


@pytest.mark.parametrize("byte_order", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_the_gguf_walk_counts_what_the_reader_holds(tmp_path, byte_order):
    """The walk before gguf's reader ends where the reader's tensor infos do, and counts the objects it
    holds: every value type, arrays of each, arrays of arrays, tensors; in either byte order."""
    path = str(tmp_path / "every.gguf")
    writer = gguf.GGUFWriter(path, "llama", endianess=byte_order)
    kinds = gguf.GGUFValueType
    for kind in (kinds.UINT8, kinds.INT8, kinds.UINT16, kinds.INT16, kinds.UINT32, kinds.INT32, kinds.UINT64,
                 kinds.INT64, kinds.FLOAT32, kinds.FLOAT64, kinds.BOOL):  # fmt: skip
        writer.add_key_value(f"one.{kind.name}", 1, kind)
        writer.add_key_value(f"array.{kind.name}", [1, 0, 1], kinds.ARRAY, sub_type=kind)
    writer.add_string("one.STRING", "text")
    writer.add_array("array.STRING", ["", "a", "bc" * 40])
    writer.add_array("array.ARRAY", [[1, 2], ["x", "yz"], [[3], [4, 5]]])
    for i in range(3):
        writer.add_tensor(f"t.{i}", np.zeros((2, 3 + i), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    header = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")
    held = sum(len(field.parts) for key, field in reader.fields.items() if key not in header)
    held += sum(len(tensor.field.parts) + 1 for tensor in reader.tensors)  # its parts and its data
    last = reader.tensors[-1].field
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        walk = gguf_file._GgufWalk(path, data)
        walk.walk()
        assert walk.parts == held and walk.at == last.offset + sum(part.nbytes for part in last.parts)


@pytest.mark.parametrize("case", ["beyond memory", "a NaN weight"])
def test_a_crafted_preset_is_refused_by_name_before_anything_is_written(text_batches, tmp_path, capsys, case):
    """A preset whose token embedding is an HDF5 dataset never written (its chunks are absent: it reads
    as zeros) of 2^36 rows: a few KB for 8.8 TB of weights; or one whose weight holds a NaN."""
    _, batches, _ = text_batches
    if case == "beyond memory":
        path = copied_preset(tmp_path, "huge", ("config.json", lambda c: c["config"].update(vocabulary_size=2**36)))

        def edit(store, name, values):
            if name == keras_hub_preset._EMBEDDING:
                store.create_dataset(name, shape=(2**36, 16), dtype="float32", chunks=(1024, 16))
            else:
                store.create_dataset(name, data=values)

        message = r"its 1,099,511,631,696 weights in float32, with their copy read from the file, hold about 8,192 GiB"
    else:
        path = copied_preset(tmp_path, "nan")

        def edit(store, name, values):
            store.create_dataset(name, data=np.where(name.endswith("_feedforward_gate_dense/vars/0"), np.nan, values))

        message = r"layers/llama_transformer_decoder/_feedforward_gate_dense/vars/0 in model.weights.h5 holds NaN"
    rewrite_weights(path, edit)
    out = str(tmp_path / "out")
    assert assert_refused_before_writing(batches, out, lambda: train_causal_lm(batches, out, path)) == 2
    err = capsys.readouterr().err
    assert re.search(f"--pretrained {re.escape(path)}: {message}", err) and "Traceback" not in err, err


def test_token_features_are_a_weighted_mean_of_the_embeddings_without_their_common_directions(tiny):
    """An independent reference: the tensor read with gguf's own reader, the directions by an SVD
    (text_models.TokenFeatures takes an eigendecomposition), the weighted mean taken before centering."""
    loaded = pretrained.read_pretrained(tiny)
    features = text_models.TokenFeatures.of(loaded.tokenizer, loaded.layer_weights()["token_embd"][0])
    found = [t for t in gguf.GGUFReader(tiny).tensors if t.name == "token_embd.weight"][0]
    table = np.asarray(found.data, dtype=np.float64).reshape(300, 32)
    unit = table / np.linalg.norm(table, axis=1, keepdims=True)
    common = np.linalg.svd(unit - unit.mean(axis=0), full_matrices=False)[2][: text_models.COMMON_DIRECTIONS]
    texts = [*VARIED[:4], "", "the the the"]
    computed = features(np.array([t.encode() for t in texts], dtype=object), 16)
    assert computed.shape == (6, 32) and computed.dtype == np.float32
    for row, value in enumerate(texts):
        ids = loaded.tokenizer.encode(value)[:16]
        if not ids:
            assert not computed[row].any()
            continue
        weights = np.array(ids) / (np.array(ids) + text_models.RARE_TOKEN_RANK)
        g = (unit[ids] * weights[:, None]).sum(axis=0) / weights.sum() - unit.mean(axis=0)
        g -= common.T @ (common @ g)
        np.testing.assert_allclose(computed[row], g / np.linalg.norm(g), atol=2e-5)
        alone = features(np.array([value.encode()], dtype=object), 16)[0]  # a row's feature is its own
        np.testing.assert_array_equal(alone, computed[row])


@pytest.mark.parametrize(
    "crafted, message",
    [
        (
            {"tensors": lambda name, values: values[:200] if name == "token_embd.weight" else values},
            r"tensor 'token_embd.weight' has shape \(200, 32\), where the metadata gives \(300, 32\)",
        ),
        ({"tensors": one_nan("token_embd.weight")}, "tensor 'token_embd.weight' holds NaN or infinite values"),
    ],
)
def test_a_pretrained_table_the_feature_cannot_use_is_a_clear_error(tmp_path, crafted, message):
    from madp.training.tasks import TextClassifierTask

    path = write_tiny_gguf(str(tmp_path / "crafted.gguf"), **crafted)
    schema = {"text": Feature("text", "bytes", ()), "label": Feature("label", "bytes", ())}
    options = TrainOptions(model="text-classifier", mechanism="none", pretrained=path)
    with pytest.raises(InputError, match=message):
        TextClassifierTask(options, schema, ["a", "b"])


def test_the_text_classifier_trains_beside_a_frozen_pretrained_feature(text_batches, tiny, tmp_path):
    from madp.cli import main

    _, batches, evaluation = text_batches
    out = str(tmp_path / "classifier")
    labels = "business,science,sports,travel"
    arguments = ["-q", "train", batches, out, "--model", "text-classifier", "--labels", labels, "--pretrained", tiny,
                 "--buckets", "256", "--noise-multiplier", "0.5", "--noise-seed", "1", "--eval-data", evaluation,
                 "--eval-every", "4", "--ngrams", "1", "--l2", "1e-3", "--word-prefix", "5"]  # fmt: skip
    assert main(arguments) == 0
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    features = (metrics["text_features"]["ngrams"], metrics["text_features"]["word_prefix"], metrics["l2"])
    assert features == (1, 5, 1e-3)  # the defaults beside it: 2, whole words (0) and none
    final = evaluation_of(out, internal=True)["final"]
    assert 0 <= final["accuracy"] <= 1 and set(final["per_class"]) == {"business", "science", "sports", "travel"}
    assumptions = json.load(open(os.path.join(out, "privacy.json")))["assumptions"]
    assert any(tiny in a and "not trained on the private records" in a for a in assumptions)
    model = tf_keras.models.load_model(os.path.join(out, "model.keras"))
    assert (
        sorted(model.input) == [text_models.NGRAMS, text_models.PRETRAINED]
        and model.input[text_models.PRETRAINED].shape[1] == 32
    )
    # the n-gram bag (a linear model: one column per label) and the softmax layer on the feature, nothing pretrained
    assert [tuple(v.shape) for v in model.trainable_variables] == [(256, 4), (32, 4), (4,)]
    assert main(["-q", "train", batches, str(tmp_path / "lm"), "--model", "text-lm", "--pretrained", tiny]) != 0


def test_a_resume_with_other_pretrained_files_at_the_same_path_is_refused(text_batches, tiny, tmp_path, monkeypatch):
    """The assumption names the model's files by their SHA-256, so privacy.json says which model it was
    and the checkpoint's plan is not the resumed one's when the files at --pretrained changed."""
    import shutil

    from conftest import crash_at

    from madp.core import storage

    _, batches, _ = text_batches
    model, out = str(tmp_path / "model.gguf"), str(tmp_path / "out")
    shutil.copy(tiny, model)
    labels = ("business", "science", "sports", "travel")
    options = TrainOptions(model="text-classifier", labels=labels, pretrained=model, buckets=256,
                           noise_multiplier=0.5, noise_seed=1, checkpoint_every=2)  # fmt: skip
    crash_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train(batches, out, options)
    monkeypatch.undo()
    with open(model, "ab") as handle:  # other bytes at the same path; the model still reads the same
        handle.write(b"\0" * 64)
    resumed = dataclasses.replace(options, resume=True)
    with pytest.raises(InputError, match=r"another privacy plan \(its assumptions differ"):
        train(batches, out, resumed)
    shutil.copy(tiny, model)  # the files of the interrupted training: it finishes
    assert train(batches, out, resumed).metrics.settings["resumed_at"] == 2
    assumptions = json.load(open(os.path.join(out, "privacy.json")))["assumptions"]
    assert any(f"{model} (--pretrained, SHA-256 {storage.sha256(tiny)})" in a for a in assumptions)


def test_a_model_whose_file_changes_while_it_is_read_is_refused(text_batches, tiny, tmp_path, monkeypatch):
    """The digest named in privacy.json is taken before the model is read and again after: a file
    replaced meanwhile would be named but not trained from."""
    import shutil

    from madp.training import pretrained

    _, batches, _ = text_batches
    model = str(tmp_path / "model.gguf")
    shutil.copy(tiny, model)
    read = pretrained.read_pretrained

    def read_then_replaced(path):
        found = read(path)
        with open(model, "ab") as handle:
            handle.write(b"\0" * 64)
        return found

    monkeypatch.setattr(pretrained, "read_pretrained", read_then_replaced)
    options = TrainOptions(model="text-classifier", labels=("business", "science", "sports", "travel"),
                           pretrained=model, buckets=256, noise_multiplier=0.5, noise_seed=1)  # fmt: skip
    with pytest.raises(InputError, match="its files changed while madp read them"):
        train(batches, str(tmp_path / "out"), options)
    assert not os.path.exists(tmp_path / "out" / "privacy.json")


@pytest.mark.parametrize("elsewhere", ["external link", "external storage"])
def test_a_preset_weight_stored_outside_its_weights_file_is_refused(tmp_path, elsewhere):
    """The preset's digest covers its files: a weight that HDF5 reads from another file (a hidden one
    the digest leaves out, or one outside the preset) could change while the digest does not."""
    import shutil

    import h5py

    from madp.training import pretrained

    preset = str(tmp_path / "preset")
    shutil.copytree(os.path.join(DATA, "keras_hub_llama"), preset)
    key = "layers/llama_layer_norm/vars/0"
    with h5py.File(os.path.join(preset, "model.weights.h5"), "r+") as store:
        values = store[key][()]
        del store[key]
        if elsewhere == "external link":
            with h5py.File(os.path.join(preset, ".weights.h5"), "w") as other:
                other[key] = values
            store[key] = h5py.ExternalLink(".weights.h5", key)
        else:
            values.astype(values.dtype.newbyteorder("<")).tofile(os.path.join(preset, ".raw.bin"))
            store.create_dataset(key, values.shape, values.dtype, external=[(".raw.bin", 0, values.nbytes)])
    with pytest.raises(InputError, match=f"{key} in model.weights.h5 is stored in another file"):
        pretrained.read_pretrained(preset).layer_weights()


def test_a_preset_is_named_by_the_digest_of_its_files_but_hidden_ones(tmp_path):
    """A downloader's cache or .git beside a preset's files changes nothing a reader of the model reads."""
    import shutil

    from madp.training.plan import pretrained_is_public

    preset = str(tmp_path / "preset")
    shutil.copytree(os.path.join(DATA, "keras_hub_llama"), preset)
    named = pretrained_is_public(preset)
    os.makedirs(os.path.join(preset, ".cache", "huggingface"))
    open(os.path.join(preset, ".cache", "huggingface", "config.json.metadata"), "w").write("etag")
    assert pretrained_is_public(preset) == named
    open(os.path.join(preset, "config.json"), "a").write(" ")
    assert pretrained_is_public(preset) != named


def test_the_command_line_takes_pretrained(text_batches, tmp_path, capsys):
    from madp.cli import main

    _, batches, evaluation = text_batches
    out = str(tmp_path / "out")
    assert main(["-q", "train", batches, out, "--model", "causal-lm", "--mechanism", "none",
                 "--pretrained", str(tmp_path / "nothing.gguf")]) != 0  # fmt: skip
    assert "nothing.gguf: no such file" in capsys.readouterr().err
    preset = os.path.join(DATA, "keras_hub_llama")  # a keras-hub preset, fine-tuned with DP-SGD and LoRA
    assert main(["-q", "train", batches, out, "--model", "causal-lm", "--pretrained", preset, "--lora-rank", "2",
                 "--max-length", "12", "--noise-multiplier", "0.5", "--noise-seed", "1", "--eval-data", evaluation,
                 "--eval-every", "4"]) == 0  # fmt: skip
    metrics = evaluation_of(out, internal=True)
    assert metrics["pretrained_eval"]["tokens"] == metrics["final"]["tokens"] > 100
    assert any(preset in a for a in json.load(open(os.path.join(out, "privacy.json")))["assumptions"])
    assert metrics["final"]["loss"] != metrics["pretrained_eval"]["loss"]


# --- the real model (when `make pretrained` fetched it) -----------------------------------------

ENGLISH = [
    "The history of the city goes back more than two thousand years. It was founded on the banks of a river, "
    "where traders met to exchange goods from the north and the south. Over the centuries it grew into an "
    "important centre of commerce and learning, with a university, a cathedral and a busy port.",
    "Today the city is known for its museums, its parks and its food. Visitors come from all over the world to "
    "walk through the old town, to see the paintings in the national gallery and to taste the local dishes.",
    "Regular exercise improves both physical and mental health. Even a short walk every day can lower blood "
    "pressure, help people sleep better and reduce stress. Doctors recommend at least thirty minutes of "
    "moderate activity on most days of the week.",
]


@pytest.fixture(scope="module")
def smollm2():
    if not os.path.isfile(SMOLLM2):
        pytest.skip(f"SmolLM2-135M is not in the cache ({SMOLLM2}): run `make pretrained`")
    loaded = pretrained.read_pretrained(SMOLLM2)
    return loaded, pretrained.pretrained_model(loaded)


def test_smollm2_tokenizes_english_and_predicts_it(smollm2):
    loaded, model = smollm2
    tokenizer = loaded.tokenizer
    assert loaded.config.layers == 30 and loaded.config.tied_output and loaded.config.vocabulary == 49152
    assert tokenizer.encode("Hello world") == [19556, 905] and len(tokenizer.encode(" the")) == 1
    for text in VARIED:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    x, y = bpe_tokenizer.token_sequences(tokenizer, [t.encode() for t in ENGLISH], 64)
    metrics = pretrained.mean_token_loss(model, x, y)
    # measured 2.5 nats/token; Q/K rows left in llama.cpp's order gave 4.4, a random model ln(49152) = 10.8
    assert metrics["loss"] < 3.5, metrics
    assert pretrained.greedy_continuation(model, tokenizer, "The capital of France is", 3).strip().startswith("Paris")


def test_smollm2_logits_match_an_independent_numpy_forward_pass(smollm2):
    loaded, model = smollm2
    ids = np.array([loaded.tokenizer.bos, *loaded.tokenizer.encode("The capital of France is Paris, and")], np.int32)
    logits = np.asarray(model(ids[None]))[0]
    reference = reference_logits(SMOLLM2, ids)
    assert np.abs(reference).max() > 10  # 30 blocks of real weights, not a near-zero output
    # float32 against float64 through 30 blocks: measured max difference 7e-5 (logits up to 31)
    np.testing.assert_allclose(logits, reference, atol=5e-4, rtol=0)
    assert (logits.argmax(axis=1) == reference.argmax(axis=1)).all()


# --- steps compiled by XLA (--xla) --------------------------------------------------------------


def _lm_rows(rows: int, length: int = 12, seed: int = 0):
    """Token ids, next-token targets and weights (a padding row at weight 0, one at 0.5) of a step."""
    ids = np.random.default_rng(seed).integers(0, 300, (rows, length)).astype(np.int32)
    targets = np.concatenate([ids[:, 1:], np.full((rows, 1), -1, np.int32)], axis=1)
    weight = np.ones(rows, np.float32)
    weight[[1, 2]] = [0.0, 0.5]
    return ids, targets, weight


def _lm_step(tiny, lora_rank: int, mechanism: str, jit_compile: bool, noise: float = 0.0, **kwargs):
    from madp.core.randomness import SecretKey
    from madp.training.queries import BandMfQuery, DpSgdQuery
    from madp.training.steps import NonPrivateStep, PrivateStep

    tf_keras.utils.set_random_seed(0)  # the same LoRA adapters in both models
    model = pretrained.pretrained_model(pretrained.read_pretrained(tiny), 12, lora_rank)
    optimizer = tf_keras.optimizers.Adam(0.01)
    if mechanism == "none":
        return NonPrivateStep(model, pretrained.next_token_loss, optimizer, jit_compile=jit_compile, **kwargs)
    key = SecretKey.from_seed(7, "training noise")
    template = [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables]
    query = DpSgdQuery(0.5, noise, key) if mechanism == "dpsgd" else BandMfQuery(0.5, noise, key, [1.0, 0.5], template)
    return PrivateStep(model, pretrained.next_token_loss, optimizer, query, 8.0, jit_compile=jit_compile, **kwargs)


@pytest.mark.parametrize("lora_rank, mechanism", [(0, "dpsgd"), (2, "bandmf"), (2, "none")])
def test_a_step_compiled_by_xla_updates_the_model_as_the_plain_step_does(tiny, lora_rank, mechanism):
    """Without noise, three XLA-compiled steps (clipping, BandMF's state, Adam) leave the same weights
    as the plain steps; the compiled step is one XLA program (its HLO exists)."""
    plain, compiled = (_lm_step(tiny, lora_rank, mechanism, jit) for jit in (False, True))
    for seed in range(3):
        ids, targets, weight = _lm_rows(8, seed=seed)
        plain(ids, targets, weight)
        compiled(ids, targets, weight)
    for a, b in zip(plain.model.trainable_variables, compiled.model.trainable_variables, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-3, atol=2e-5, err_msg=a.name)
    start = _lm_step(tiny, lora_rank, mechanism, False).model.trainable_variables
    changed = sum(not np.allclose(np.asarray(s), np.asarray(a)) for s, a in zip(start, plain.model.trainable_variables))
    assert changed == len(start)  # every trained weight moved: the comparison is not of two untouched models
    args = (tf.constant(ids), tf.constant(targets), tf.constant(weight))
    groups = () if mechanism == "none" else (tf.range(8),)
    assert "HloModule" in compiled._replica_step.experimental_get_compiler_ir(*args, *groups)(stage="hlo")


def test_noise_drawn_inside_an_xla_step_has_its_law(tiny):
    """Zero-weight rows: the privatized gradient is the noise alone over B. Inside XLA, DP-SGD's is
    N(0, (sigma C / B)^2) per coordinate, independent across steps; BandMF's (bands 1, 0.5) has
    w_2 = z_2 - 0.5 w_1, so corr(w_1, w_2) = -0.5 / sqrt(1.25)."""
    ids, targets, _ = _lm_rows(4)
    silent = np.zeros(4, np.float32)
    for mechanism, correlation in (("dpsgd", 0.0), ("bandmf", -0.5 / np.sqrt(1.25))):
        step = _lm_step(tiny, 0, mechanism, True, noise=2.0)
        draws = [np.concatenate([np.ravel(g) for g in step.privatized_gradient(ids, targets, silent)]) for _ in "ab"]
        assert draws[0].size > 20_000
        for draw in draws if mechanism == "dpsgd" else draws[:1]:
            assert abs(draw.std() / (2.0 * 0.5 / 8.0) - 1) < 0.03 and abs(draw.mean()) < 0.003
        assert abs(np.corrcoef(*draws)[0, 1] - correlation) < 0.03


def test_xla_steps_padded_to_one_size_compile_once(tiny):
    """Steps of 5, 8 and 3 rows padded to 8 reuse the first step's program (its first call may trace
    twice: Adam's slots are created in it)."""
    step = _lm_step(tiny, 2, "dpsgd", True, noise=1.0, rows_per_replica=8)
    step(*_lm_rows(5))
    first = step._replica_step.experimental_get_tracing_count()
    for rows in (8, 3):
        step(*_lm_rows(rows, seed=rows))
    assert step._replica_step.experimental_get_tracing_count() == first
    unpadded = _lm_step(tiny, 2, "dpsgd", True, noise=1.0)  # the counter counts: each size traces anew
    for rows in (5, 3):
        unpadded(*_lm_rows(rows, seed=rows))
    assert unpadded._replica_step.experimental_get_tracing_count() > first


def test_mixed_precision_computes_in_bfloat16_and_clips_each_row_in_float32(tmp_path):
    """Under mixed precision the layers compute in bfloat16 (weights float32), and every row's clipped
    gradient is formed in float32 from that row alone: its norm is the clip norm to float32 precision,
    and the batch's clipped sum is the sum of the rows' clipped alone (a bfloat16 product over the
    batch would round the sum, so that one row moves it by more than the clip norm)."""
    from madp.training.clipping import per_example_gradients
    from madp.training.ghost_clipping import ghost_clipped_sum, ghost_norms
    from madp.training.steps import compute_precision

    loaded = pretrained.read_pretrained(write_tiny_gguf(str(tmp_path / "model.gguf"), tied=True))
    with compute_precision(True):
        model = pretrained.pretrained_model(loaded, 10)
    assert tf_keras.mixed_precision.global_policy().name == "float32"  # restored on leaving
    assert model.get_layer("blk_0_attn_q").compute_dtype == "bfloat16" and model.dtype == "float32"
    assert model(np.zeros((1, 10), np.int32)).dtype == tf.bfloat16
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 40, (5, 10)).astype(np.int32)
    targets = np.concatenate([ids[:, 1:], np.full((5, 1), -1, np.int32)], axis=1)
    weight = np.array([1, 0, 0.5, 1, 2], np.float32)
    each = per_example_gradients(model, pretrained.next_token_loss, ids, targets, weight)
    norms = np.sqrt(sum((np.asarray(g, np.float64).reshape(5, -1) ** 2).sum(axis=1) for g in each))
    ghost = np.asarray(ghost_norms(model, pretrained.next_token_loss, ids, targets, weight))
    np.testing.assert_allclose(ghost, norms, rtol=2e-2)  # both from bfloat16 activations
    clip = 0.5 * float(np.median(norms[norms > 0]))  # every row above it is clipped
    total = [np.asarray(t, np.float64) for t in ghost_clipped_sum(model, pretrained.next_token_loss, ids, targets,
                                                                    weight, clip)]  # fmt: skip
    rows = []
    for j in range(5):
        alone = np.where(np.arange(5) == j, weight, 0).astype(np.float32)
        rows.append([np.asarray(t, np.float64) for t in ghost_clipped_sum(model, pretrained.next_token_loss, ids,
                                                                          targets, alone, clip)])  # fmt: skip
        norm = np.sqrt(sum((t**2).sum() for t in rows[-1]))
        assert norm == 0 if j == 1 else abs(norm / clip - 1) < 1e-5
    for got, *parts in zip(total, *rows, strict=True):
        np.testing.assert_allclose(got, sum(parts), rtol=1e-5, atol=1e-6 * np.abs(got).max())


def test_madp_train_xla_mixed_precision_trains_the_causal_lm_and_refuses_several_devices(text_batches, tiny):
    directory, batches, evaluation = text_batches
    options = TrainOptions(model="causal-lm", pretrained=tiny, lora_rank=2, max_length=16, eval_data=evaluation,
                           eval_every=4, noise_multiplier=0.5, noise_seed=1, xla=True,
                           mixed_precision=True)  # fmt: skip
    result = train(batches, str(directory / "trained-xla"), options)
    final = evaluation_of(str(directory / "trained-xla"), internal=True)["final"]
    settings = result.metrics.settings
    assert settings["xla"] is True and settings["mixed_precision"] is True and math.isfinite(final["loss"])
    saved = tf_keras.models.load_model(str(directory / "trained-xla" / "model.keras"), compile=False)
    assert saved.get_layer("blk_0_attn_q").compute_dtype == "bfloat16"
    with pytest.raises(InputError, match="^xla compiles the step of one device"):
        TrainOptions(mechanism="none", xla=True, distribution="mirrored")
