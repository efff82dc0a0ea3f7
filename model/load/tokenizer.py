"""Tokenizer built with the `tokenizers` library from GGUF metadata or an HF tokenizer.json."""

from __future__ import annotations

import functools
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing

from model.errors import ModelLoadError

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) by `tokenizer.ggml.pre`.
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
# "lfm2": llama.cpp gives LFM2 Llama 3's pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_LLAMA3)
_SPLIT_RES = {"llama3": _LLAMA3_RE, "llama-bpe": _LLAMA3_RE, "lfm2": _LLAMA3_RE, "qwen2": _QWEN2_RE}
# Tokens llama.cpp treats as end-of-generation when present (llama_vocab::impl::load).
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>")
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4
# fill-in-the-middle token ids in GGUF metadata (llama.cpp's LLM_KV_TOKENIZER_FIM_*_ID; the
# older prefix/suffix/middle keys too)
_FIM_KEYS = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "pad": ("tokenizer.ggml.fim_pad_token_id",),
    "rep": ("tokenizer.ggml.fim_rep_token_id",),
    "sep": ("tokenizer.ggml.fim_sep_token_id",),
}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class Tokenizer:
    def __init__(
        self,
        tok: HFTokenizer,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: set[int],
        byte_level: bool,
        special_ids: set[int],
        added_ids: set[int] | None = None,
        fim_ids: dict[str, int] | None = None,
    ) -> None:
        self._tok = tok
        self.bos_id = bos_id
        self.eos_id = eos_id  # the template's eos_token
        self.eos_ids = eos_ids  # every end-of-generation id
        self.byte_level = byte_level
        self.special_ids = special_ids
        self.added_ids = special_ids | (added_ids or set())  # matched whole, spelled verbatim
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        # FIM ids the GGUF names ("pre", "suf", "mid", "pad", "rep", "sep"); server/fim.py
        # looks the rest up in the vocabulary, as llama.cpp does
        self.fim_ids = dict(fim_ids or {})

    @property
    def hf(self) -> HFTokenizer:
        """The `tokenizers` object (llguidance builds its token trie from its JSON)."""
        return self._tok

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """BOS is added if the model wants (add_special); special (control) tokens written in
        `text` become their ids, or with parse_special=False stay text, as llama.cpp's
        tokenizer reads them then (user-defined added tokens match either way, in both)."""
        tok = self._tok if parse_special else self._plain
        return tok.encode(text, add_special_tokens=add_special).ids

    @functools.cached_property
    def _plain(self) -> HFTokenizer:
        """A copy that reads special tokens' spellings as text (built on first use)."""
        plain = HFTokenizer.from_str(self._tok.to_str())
        plain.encode_special_tokens = True
        return plain

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token contributes to the text (may be part of a UTF-8 char)."""
        piece = self.id_to_token(token_id)
        if token_id in self.added_ids:
            return piece.encode()
        if self.byte_level:
            table = _byte_decoder()
            return bytes(table[c] for c in piece) if all(c in table for c in piece) else b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    @staticmethod
    def from_gguf(fields: dict[str, Any], path: Path, arch: str = "") -> Tokenizer:
        """`fields`: the GGUF's tokenizer.* metadata; `arch`: general.architecture (Gemma's
        SentencePiece vocab needs its own reading, as in transformers' GGUF converter)."""
        kind = fields.get("tokenizer.ggml.model")
        tokens: list[str] = fields.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ModelLoadError(f"{path}: the GGUF has no tokenizer (tokenizer.ggml.tokens).")
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        raw = tokens
        vocab = {t: i for i, t in enumerate(tokens)}
        if kind == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
            tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
            pre = fields.get("tokenizer.ggml.pre", "default")
            if pre in _SPLIT_RES:
                split = pre_tokenizers.Split(Regex(_SPLIT_RES[pre]), behavior="isolated")
                byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
                tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
            else:  # "default", "gpt-2", "smollm", ...: GPT-2's regex
                steps: list[Any] = [pre_tokenizers.ByteLevel(add_prefix_space=False)]
                if pre == "smollm":
                    steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
                tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
            tok.decoder = decoders.ByteLevel()
            byte_level_vocab = True
        elif kind == "llama" and arch.startswith("gemma"):
            # NOTE: Gemma stores runs of spaces as real spaces (the text side spells them "▁"),
            # and its merge order is the vocab order, not the scores; no prefix space.
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
            vocab = {t: i for i, t in enumerate(tokens)}
            tok = HFTokenizer(_spm_bpe(tokens, [-float(i) for i in range(len(tokens))], types))
            tok.normalizer = normalizers.Replace(" ", "\u2581")
            tok.decoder = decoders.Sequence(
                [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            )
            byte_level_vocab = False
        elif kind == "llama":
            scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            tok = HFTokenizer(_spm_bpe(tokens, scores, types))
            # NOTE: like transformers' LlamaTokenizer: "▁" only before the first fragment
            # (llama.cpp also adds it after each special token).
            tok.pre_tokenizer = pre_tokenizers.Metaspace("\u2581", "first", split=False)
            tok.decoder = decoders.Sequence(
                [
                    decoders.Replace("\u2581", " "),
                    decoders.ByteFallback(),
                    decoders.Fuse(),
                    decoders.Strip(" ", 1, 0),
                ]
            )
            byte_level_vocab = False
        else:
            raise ModelLoadError(f"{path}: tokenizer model {kind!r} is not supported.")
        special_ids = {i for i, t in enumerate(types) if t == _TOKEN_CONTROL}
        tok.add_tokens(
            [
                AddedToken(raw[i], special=t == _TOKEN_CONTROL, normalized=False)
                for i, t in enumerate(types)
                if t == _TOKEN_CONTROL or (t == _TOKEN_USER_DEFINED and raw[i] in vocab)
            ]
        )
        bos = fields.get("tokenizer.ggml.bos_token_id")
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        if add_bos and bos is not None:
            tok.post_processor = TemplateProcessing(
                single=f"{tokens[bos]} $A",
                pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)],
            )
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eos_ids = {
            int(fields[k])
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if fields.get(k) is not None
        }
        eos_ids |= {vocab[t] for t in _EOG_TEXTS if t in vocab and vocab[t] in special_ids}
        added_ids = {i for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED}
        fim_ids = {
            kind: int(fields[key])
            for kind, keys in _FIM_KEYS.items()
            for key in reversed(keys)  # the current key wins over the older one
            if fields.get(key) is not None
        }
        return Tokenizer(tok, bos, eos, eos_ids, byte_level_vocab, special_ids, added_ids, fim_ids)

    @staticmethod
    def from_hf_dir(folder: Path) -> Tokenizer:
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{folder}: tokenizer.json is missing.")
        tok = HFTokenizer.from_file(str(file))
        spec = json.loads(file.read_text())
        config = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        special_ids = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        bos_id = _token_id(tok, config.get("bos_token"))
        eos_ids: set[int] = set()
        eos_gen = gen.get("eos_token_id")
        eos_ids |= set(eos_gen) if isinstance(eos_gen, list) else {eos_gen} - {None}
        eos_id = eos_cfg = _token_id(tok, config.get("eos_token"))
        if eos_cfg is not None:
            eos_ids.add(eos_cfg)
        vocab = tok.get_vocab(with_added_tokens=True)
        eos_ids |= {vocab[t] for t in _EOG_TEXTS if t in vocab and vocab[t] in special_ids}
        added_ids = {a["id"] for a in spec.get("added_tokens", [])}
        return Tokenizer(tok, bos_id, eos_id, eos_ids, byte_level, special_ids, added_ids)


def _read_json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.is_file() else {}


def _token_id(tok: HFTokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else tok.token_to_id(token)


def _spm_bpe(tokens: list[str], scores: list[float], types: list[int]) -> models.BPE:
    """SentencePiece-BPE vocab as a byte-fallback BPE: merges ranked by the merged token's score
    (what HF's GGUF converter and llama.cpp's llm_tokenizer_spm both do)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int]] = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[pid], pid, vocab[left], vocab[right]))
    ranked.sort()  # best score first; ties as transformers' generate_merges orders them
    merges = [(tokens[left], tokens[right]) for _, _, left, right in ranked]
    unk = next((t for t, i in vocab.items() if types[i] == 2), None)
    return models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True)


def check_vocab(target: Tokenizer, draft: Tokenizer) -> None:
    """The draft must speak the target's tokens (llama.cpp's check: sizes within 128, the
    same text for every id both have, the same BOS / EOS); ValueError says where not."""
    if abs(target.vocab_size - draft.vocab_size) > 128:
        raise ValueError(
            f"the draft's vocabulary has {draft.vocab_size} tokens, the target's "
            f"{target.vocab_size}: they must share a tokenizer"
        )
    if (target.bos_id, target.eos_id) != (draft.bos_id, draft.eos_id):
        raise ValueError(
            f"the draft's BOS / EOS ids {draft.bos_id} / {draft.eos_id} differ from the "
            f"target's {target.bos_id} / {target.eos_id}"
        )
    for i in range(min(target.vocab_size, draft.vocab_size)):
        if target.id_to_token(i) != draft.id_to_token(i):
            raise ValueError(
                f"token {i} is {target.id_to_token(i)!r} in the target and "
                f"{draft.id_to_token(i)!r} in the draft: they must share a tokenizer"
            )
