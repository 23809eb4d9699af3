"""A Llama-architecture model in a keras-hub preset directory (what `save_to_preset` writes), read
without keras-hub: `read_preset` checks its config.json, its tokenizer (`assets/tokenizer/`) and the
outline of its `model.weights.h5` before any model is built, and gives its configuration, its
byte-level BPE tokenizer and, read when loaded with h5py, its weights (`_preset_weights`).

Preset facts this relies on (keras-hub 0.32's LlamaBackbone and Llama3Backbone): `config.json` names
the backbone class and its sizes; `model.weights.h5` holds each layer's variables under
`layers/<layer>/.../vars/<i>`, the decoder blocks as `llama_transformer_decoder`, `..._1`, ... in
order; attention kernels are EinsumDense [width, heads, head_dim] (output: [heads, head_dim, width])
and its RoPE rotates halves, like Hugging Face's; `reversible_embedding/vars/1`, when present, is the
separate LM head [width, vocabulary].
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from typing import Any

import numpy as np

from madp.core.errors import InputError, OptionError
from madp.training.bpe_tokenizer import BpeTokenizer, check_vocabulary
from madp.training.pretrained_files import (
    LlamaConfig,
    Pretrained,
    check_model_memory,
    check_sizes,
    finite_weights,
)

# keras-hub backbones of this architecture, and the tokenizer class whose special tokens madp knows
PRESET_BACKBONES = ("LlamaBackbone", "Llama3Backbone")
PRESET_TOKENIZER = "Llama3Tokenizer"
LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"  # what keras-hub's Llama3Tokenizer uses


def read_preset(path: str) -> Pretrained:
    """A keras-hub preset directory of a Llama backbone (`PRESET_BACKBONES`, no RoPE scaling) with a
    Llama 3 byte-level BPE tokenizer: `config.json`, `model.weights.h5`, `tokenizer.json` and
    `assets/tokenizer/{vocabulary.json, merges.txt}`. Sizes, the weights' shapes and blocks, and the
    tokenizer are checked here, before any model is built."""
    backbone = preset_json(path, "config.json")
    if backbone.get("class_name") not in PRESET_BACKBONES:
        raise OptionError(
            "{pretrained} {0}: a {1!r} preset; madp reads the keras-hub backbones {2}",
            path,
            backbone.get("class_name"),
            list(PRESET_BACKBONES),
        )
    c = backbone.get("config")
    if not isinstance(c, dict):
        raise OptionError("{pretrained} {0}: config.json has no backbone configuration ('config')", path)
    scaled = {key: c.get(key) for key in ("rope_position_scaling_factor", "rope_frequency_adjustment_factor")}
    if scaled["rope_position_scaling_factor"] not in (None, 1, 1.0) or scaled["rope_frequency_adjustment_factor"]:
        raise OptionError(
            "{pretrained} {0}: RoPE scaling ({1}) is not implemented; madp's RoPE is unscaled", path, scaled
        )
    if not os.path.isfile(os.path.join(path, "model.weights.h5")):
        raise OptionError("{pretrained} {0}: no model.weights.h5 (sharded preset weights are not read)", path)
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
    check_sizes(path, config)
    if blocks != config.layers:
        raise OptionError(
            "{pretrained} {0}: model.weights.h5 holds {1} decoder blocks, config.json says {2}",
            path,
            blocks,
            config.layers,
        )
    if embedding != (config.vocabulary, config.width):  # before a model of the configured size is built
        raise OptionError(
            "{pretrained} {0}: {1} has shape {2}, config.json says {3}",
            path,
            _EMBEDDING,
            embedding,
            (config.vocabulary, config.width),
        )
    check_model_memory(path, config)
    tokenizer = _preset_tokenizer(path, config.vocabulary)
    return Pretrained(path, config, tokenizer, functools.partial(_preset_weights, path, config))


def _config_number(path: str, config: dict, key: str, default: float | None = None, whole: bool = True) -> Any:
    """A positive, finite number of config.json (a whole one where `whole`), or `default` if absent."""
    value = config.get(key, default)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        if not whole:
            return float(value)
        if value == int(value):
            return int(value)
    kind = "a positive whole number" if whole else "a positive finite number"
    raise OptionError("{pretrained} {0}: config.json {1} is {2!r}, not {3}", path, key, value, kind)


def preset_json(path: str, name: str) -> dict:
    """The JSON object in file `name` of a preset directory (InputError if it is absent or not one)."""
    try:
        with open(os.path.join(path, name), encoding="utf-8") as handle:
            value = json.load(handle)
    except FileNotFoundError:
        raise OptionError("{pretrained} {0}: a directory without {1} (not a keras-hub preset)", path, name) from None
    except (OSError, ValueError, RecursionError) as error:
        raise OptionError("{pretrained} {0}: unreadable {1} ({2})", path, name, type(error).__name__) from None
    if not isinstance(value, dict):
        raise OptionError("{pretrained} {0}: {1} is not a JSON object", path, name)
    return value


def _preset_tokenizer(path: str, model_vocabulary: int) -> BpeTokenizer:
    """keras-hub's Llama3Tokenizer: its vocabulary and merges, Llama 3's pre-tokenizer, and its special
    tokens (`unsplittable_tokens`) as control tokens. The vocabulary must give every token a distinct
    id below the model's vocabulary and hold every byte's symbol and every merge's result, so that
    any text tokenizes."""
    tokenizer = preset_json(path, "tokenizer.json")
    assets = os.path.join(path, "assets", "tokenizer")
    if tokenizer.get("class_name") != PRESET_TOKENIZER:
        raise OptionError(
            "{pretrained} {0}: a {1!r} tokenizer; madp reads keras-hub's {2} (byte-level BPE; "
            "SentencePiece tokenizers are not implemented)",
            path,
            tokenizer.get("class_name"),
            PRESET_TOKENIZER,
        )
    settings = tokenizer.get("config")
    settings = settings if isinstance(settings, dict) else {}
    if settings.get("add_prefix_space"):
        raise OptionError("{pretrained} {0}: a tokenizer with add_prefix_space is not implemented", path)
    special = settings.get("unsplittable_tokens", [LLAMA3_BOS, LLAMA3_EOS])
    if not isinstance(special, list) or not all(isinstance(token, str) for token in special):
        raise OptionError("{pretrained} {0}: tokenizer.json unsplittable_tokens is not a list of strings", path)

    def bad(why: str) -> InputError:
        return OptionError("{pretrained} {0}: {1}: {2}", path, assets, why)

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
    check_vocabulary(vocabulary, merges, bad, "vocabulary.json", "merges.txt line")
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
        raise OptionError(
            "{pretrained} {0}: model.weights.h5 is not a readable HDF5 file ({1})", path, str(error)
        ) from None


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


def _preset_weights(path: str, config: LlamaConfig) -> dict[str, list[np.ndarray]]:
    """The weights of each layer of `llama_model`, by layer name, from a preset's model.weights.h5:
    each dataset must have exactly the shape keras-hub gives it (attention kernels [width, heads,
    head_dim], the output projection [heads, head_dim, width]), reshaped to madp's Dense kernels."""
    import h5py

    c = config
    with _open_h5(path) as store:

        def read(key: str, stored: tuple[int, ...], shape: tuple[int, ...] | None = None) -> list[np.ndarray]:
            found = store.get(key)
            if not isinstance(found, h5py.Dataset):
                raise OptionError("{pretrained} {0}: model.weights.h5 has no dataset {1!r}", path, key)
            # The preset's digest covers its files' bytes: a weight read from elsewhere (an external
            # link, external or virtual storage) could change while the digest does not.
            if found.file.filename != store.filename or found.external or found.is_virtual:
                raise OptionError(
                    "{pretrained} {0}: {1} in model.weights.h5 is stored in another file; a preset's weights "
                    "must lie in model.weights.h5 itself",
                    path,
                    key,
                )
            if tuple(found.shape) != stored:
                raise OptionError(
                    "{pretrained} {0}: {1} has shape {2}, expected {3}", path, key, tuple(found.shape), stored
                )
            try:
                values = _float32(found)
            except (TypeError, ValueError, OSError, KeyError) as error:
                raise OptionError(
                    "{pretrained} {0}: unreadable {1} in model.weights.h5 ({2})", path, key, error
                ) from None
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
