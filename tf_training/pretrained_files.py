"""What reading a pretrained model's files gives, whichever their format (a GGUF file: `gguf_file`; a
keras-hub preset: `keras_hub_preset`): the Llama architecture's sizes (`LlamaConfig`) and a
`Pretrained` of them, its tokenizer and its weights; with the checks each reader makes of them
before any model is built: consistent sizes, weights that fit in memory, finite weights."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from madp.core.errors import OptionError, check_memory
from madp.training.bpe_tokenizer import BpeTokenizer


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The architecture's sizes, as a GGUF file's metadata (the `llama.*` keys named below) or a
    keras-hub preset's config.json gives them."""

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


def _parameter_count(config: LlamaConfig) -> int:
    """The number of weights of `llama_model(config)` (LoRA adapters aside)."""
    c = config
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    block = 2 * c.width + 2 * c.width * q + 2 * c.width * kv + 3 * c.width * c.hidden
    return c.vocabulary * c.width * (1 if c.tied_output else 2) + c.width + c.layers * block


def check_sizes(path: str, config: LlamaConfig) -> None:
    """Refuse sizes that make no model of the architecture: none below 1, query heads in whole groups
    of K/V heads, heads that make up the width, an even head size."""
    sizes = (config.vocabulary, config.layers, config.width, config.hidden, config.heads, config.kv_heads)
    if min(sizes) < 1 or config.heads % config.kv_heads or config.head_dim * config.heads != config.width:
        raise OptionError("{pretrained} {0}: inconsistent sizes {1}", path, config)
    if config.head_dim % 2:  # RoPE rotates the two halves of a head
        raise OptionError("{pretrained} {0}: an odd head size {1}", path, config.head_dim)


def check_model_memory(path: str, config: LlamaConfig) -> None:
    """Refuse, before any model is built, a model whose float32 weights and their copy read from the
    file would fill more than half of this machine's memory (a file can state sizes that its bytes
    do not hold: quantized, or GGUF tensors that share their bytes)."""
    parameters = _parameter_count(config)
    check_memory(
        8 * parameters,
        f"--pretrained {path}: its {parameters:,} weights in float32, with their copy read from the file, hold",
        "fine-tune a smaller model, or on a machine with more memory",
    )


def finite_weights(path: str, name: str, values: np.ndarray) -> np.ndarray:
    """Weights as read from a file, refused where one is NaN or infinite: the model would compute NaN
    for every row, and DP-SGD, whose clipping gives such a row no weight, would train it on noise alone."""
    if not np.isfinite(values).all():
        raise OptionError("{pretrained} {0}: {1} holds NaN or infinite values", path, name)
    return values
