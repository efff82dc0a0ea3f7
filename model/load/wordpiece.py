"""BERT's WordPiece tokenizer from a GGUF's vocabulary (llama.cpp's `tokenizer.ggml.model =
bert`).

llama.cpp's converter (BertModel.set_vocab) rewrites the vocabulary into its "phantom space"
spelling: a word-initial piece gains a leading U+2581, a continuation loses its "##", control
tokens ([CLS], [SEP], ...) stay verbatim. This undoes it into a `tokenizers` WordPiece with
BERT's normaliser and pre-tokenizer, adding [CLS] ... [SEP] (BOS / EOS in the GGUF) around
each input as llama.cpp's WPM tokenizer does. Like llama.cpp, the text is lowercased and its
accents stripped (the uncased models these GGUFs come from).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing

from model.errors import ModelLoadError
from model.load.tokenizer import Tokenizer

PHANTOM = "\u2581"
_TOKEN_CONTROL = 3


def unphantom(token: str, token_type: int) -> str:
    """The WordPiece spelling of a llama.cpp BERT vocabulary entry."""
    if token_type == _TOKEN_CONTROL:
        return token
    return token[1:] if token.startswith(PHANTOM) else "##" + token


def wordpiece_from_gguf(fields: dict[str, Any], path: Path) -> Tokenizer:
    tokens: list[str] = fields.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError(f"{path}: the GGUF has no tokenizer (tokenizer.ggml.tokens).")
    types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        vocab.setdefault(unphantom(token, kind), i)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        raise ModelLoadError(f"{path}: the WordPiece vocabulary has no unknown_token_id.")
    tok = HFTokenizer(
        models.WordPiece(vocab, unk_token=tokens[unk_id], continuing_subword_prefix="##")
    )
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    special_ids = {i for i, kind in enumerate(types) if kind == _TOKEN_CONTROL}
    tok.add_special_tokens([AddedToken(tokens[i], special=True) for i in sorted(special_ids)])
    bos = fields.get("tokenizer.ggml.bos_token_id")  # [CLS]
    eos = fields.get("tokenizer.ggml.eos_token_id")  # [SEP]
    sep = fields.get("tokenizer.ggml.seperator_token_id", eos)  # llama.cpp's spelling
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", True))
    add_sep = bool(
        fields.get("tokenizer.ggml.add_sep_token", fields.get("tokenizer.ggml.add_eos_token", True))
    )
    single, special = ["$A"], []
    if add_bos and bos is not None:
        single.insert(0, tokens[bos])
        special.append((tokens[bos], bos))
    if add_sep and sep is not None:
        single.append(tokens[sep])
        special.append((tokens[sep], sep))
    if special:
        tok.post_processor = TemplateProcessing(single=" ".join(single), special_tokens=special)
    eos_ids = {int(sep)} if sep is not None else set()
    return Tokenizer(tok, bos, sep, eos_ids, False, special_ids)
