"""Writes the keras-hub preset fixtures of tests/training/test_pretrained.py, with keras-hub itself: two tiny
random Llama models saved by `save_to_preset` (`keras_hub_llama`: LlamaBackbone, 2 blocks, tied
embeddings; `keras_hub_llama3`: Llama3Backbone, 11 blocks, a separate LM head), each with a
Llama3Tokenizer of a small byte-level BPE vocabulary, and beside them `expected.json`: keras-hub's
logits for fixed token ids and its token ids for test strings (its eager Python path, which
pre-tokenizes as Llama 3 does). madp reads the presets without keras-hub; the tests compare its
logits and ids to these (the vocabulary's merges are learned with madp's pre-tokenizer: they are
only data).

Run once where keras-hub is installed (not a dependency of madp; 0.32.0 wrote the committed files):
    pip install keras-hub==0.32.0 tensorflow-text==2.21.*
    KERAS_BACKEND=tensorflow python tests/data/make_keras_hub_presets.py
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [
    os.path.dirname(os.path.dirname(HERE)),
    os.path.dirname(HERE),
    os.path.join(os.path.dirname(HERE), "training"),
]
from test_pretrained import learn_merges  # noqa: E402

from madp.training import pretrained  # noqa: E402

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs there and then. "
    "They're here, it's there, we'll see what they've done. Numbers: 1234 and 56.\n"
) * 3
STRINGS = [
    "Hello, world!",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "They're sure it's fine; I'M not, we'll see, you've been, he'd go",
    "Grüße aus Köln, ça va? Ελληνικά, русский, 漢字かな交じり, emoji 🚀🎉 and ZWJ 👩‍👩‍👧",
    "digits 2024-11-25, 3.14159, 1234567 ½ and ²",
    "the fox and the dog, then there",
    "x" * 30 + " " + "the " * 10,
]


def vocabulary_and_merges(count: int) -> tuple[dict[str, int], list[str]]:
    """Every byte's symbol (id = byte), `count` merges learned from CORPUS's pieces as Llama 3
    pre-tokenizes it, and the special tokens."""
    merges = learn_merges(CORPUS, count, pre_tokenizer="llama-bpe")
    tokens = list(dict.fromkeys([*pretrained.byte_symbols(), *(m.replace(" ", "") for m in merges)])) + SPECIAL
    return {token: i for i, token in enumerate(tokens)}, merges


def write(name: str, backbone_class, layers: int, tied: bool, seed: int) -> None:
    vocabulary, merges = vocabulary_and_merges(40)
    backbone = backbone_class(
        vocabulary_size=len(vocabulary), num_layers=layers, num_query_heads=4, hidden_dim=16, intermediate_dim=24,
        num_key_value_heads=2, rope_max_wavelength=500.0, layer_norm_epsilon=1e-5, tie_word_embeddings=tied,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    for variable in backbone.weights:  # every weight random, norms' scales too, so a wrong mapping shows
        norm = "layer_norm" in variable.path or "layernorm" in variable.path
        variable.assign(rng.normal(0, 0.3, variable.shape).astype("float32") + (1.0 if norm else 0.0))
    tokenizer = keras_hub.models.Llama3Tokenizer(vocabulary=vocabulary, merges=merges)
    directory = os.path.join(HERE, name)
    backbone.save_to_preset(directory)
    tokenizer.save_to_preset(directory)
    ids = rng.integers(0, len(vocabulary), size=(2, 7)).astype("int32")
    hidden = backbone({"token_ids": ids, "padding_mask": np.ones_like(ids)})
    logits = np.asarray(backbone.token_embedding(hidden, reverse=True))
    expected = {
        "token_ids": ids.tolist(),
        "logits": logits.round(7).tolist(),
        "strings": STRINGS,
        "encoded": [np.asarray(tokenizer(text)).tolist() for text in STRINGS],
        "bos": vocabulary["<|begin_of_text|>"],
        "eos": vocabulary["<|end_of_text|>"],
    }
    with open(os.path.join(directory, "expected.json"), "w", encoding="utf-8") as out:
        json.dump(expected, out)
    print(name, len(vocabulary), "tokens;", sorted(os.listdir(directory)))


if __name__ == "__main__":
    write("keras_hub_llama", keras_hub.models.LlamaBackbone, layers=2, tied=True, seed=1)
    # 11 blocks: the h5 names blocks 1 to 10 by suffix (`llama_transformer_decoder_10`)
    write("keras_hub_llama3", keras_hub.models.Llama3Backbone, layers=11, tied=False, seed=2)
