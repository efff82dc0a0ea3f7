"""A Hugging Face byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json, the chat
template) written into a GGUF as llama.cpp's "gpt2" vocabulary: what model/load/hf_to_gguf.py
writes beside the tensors, and what model/load/tokenizer.py reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer as HFTokenizer

from model.errors import ModelLoadError
from model.load.hf_config import read_json
from model.load.tokenizer import _SPLIT_RES

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED = 1, 3, 4, 5


def write_bpe_tokenizer(
    writer: gguf.GGUFWriter, folder: Path, config: dict[str, Any], n_vocab: int
) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" vocab, padded with unused
    [PAD{i}] tokens to the embedding's rows (llama.cpp needs one token per row)."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ModelLoadError(f"{folder}: tokenizer.json is missing (only BPE tokenizers convert).")
    spec = json.loads(file.read_text())
    if spec.get("model", {}).get("type") != "BPE":
        raise ModelLoadError(f"{folder}: the tokenizer is not BPE; it cannot be converted.")
    vocab = HFTokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    if max(vocab.values(), default=0) >= n_vocab:
        raise ModelLoadError(
            f"{folder}: the tokenizer has ids up to {max(vocab.values())}, the embedding "
            f"{n_vocab} rows."
        )
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [_TOKEN_UNUSED] * n_vocab
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = _TOKEN_NORMAL
        if i in added:
            types[i] = _TOKEN_CONTROL if added[i].get("special") else _TOKEN_USER_DEFINED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec.get("pre_tokenizer"), folder))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = spec["model"].get("merges", [])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    tok_config = read_json(folder / "tokenizer_config.json")
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        token = tok_config.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        token_id = vocab.get(token) if token is not None else config.get(f"{key}_token_id")
        if isinstance(token_id, int):
            add(token_id)
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    template = folder / "chat_template.jinja"
    source = template.read_text() if template.is_file() else tok_config.get("chat_template")
    if isinstance(source, str):
        writer.add_chat_template(source)


def _pre_tokenizer(pre: dict[str, Any] | None, folder: Path) -> str:
    """llama.cpp's tokenizer.ggml.pre name for the pre-tokenizers model/load/tokenizer.py knows."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "default"  # GPT-2's regex
    steps = (pre or {}).get("pretokenizers") or []
    if pre and pre.get("type") == "Sequence" and steps and steps[0].get("type") == "Split":
        regex = steps[0].get("pattern", {}).get("Regex")
        for name, known in _SPLIT_RES.items():
            if regex == known:
                return name
    raise ModelLoadError(f"{folder}: the tokenizer's pre-tokenizer is not one llama.cpp names.")
