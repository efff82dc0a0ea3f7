"""Fill-in-the-middle prompts from the model's FIM tokens, as llama.cpp's server builds them
(tools/server `format_prompt_infill`, the repo-level pattern of Qwen2.5-Coder,
arXiv:2409.12186):

    [FIM_REP]myproject\\n [FIM_SEP]{filename}\\n{text} ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE]{prefix}{prompt} [FIM_SUF]{suffix} [FIM_MID]

The ids come from the GGUF metadata (tokenizer.ggml.fim_*_token_id) or else from the
vocabulary's spellings that llama.cpp's llama-vocab.cpp looks for.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.backend import Tokenizer
from server.errors import APIError

# llama-vocab.cpp's spellings, in its order
FIM_SPELLINGS: dict[str, tuple[str, ...]] = {
    "pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
    ),
    "suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
    ),
    "mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
    ),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
MISSING = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
# the llama.cpp server's fixed names for the repository and the current file
REPO_NAME, CURRENT_FILE, DEFAULT_FILE = "myproject", "filename", "tmp"
# without FIM_SEP, extra chunks are separated by this text (llama.cpp's k_chunk_prefix_str)
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True, slots=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def stop_ids(self) -> frozenset[int]:
        """llama.cpp makes FIM_PAD, FIM_REP and FIM_SEP end-of-generation tokens."""
        return frozenset(t for t in (self.pad, self.rep, self.sep) if t is not None)


@dataclass(frozen=True, slots=True)
class ExtraChunk:
    filename: str
    text: str


@dataclass(frozen=True, slots=True)
class FimWindow:
    """How much of each part fits (llama.cpp: prefix:suffix 3:1 within a batch, the extra
    context in the rest of the context after 2 x n_predict)."""

    n_batch: int
    n_ctx: int
    n_predict: int  # -1: not given


def _vocab_id(tok: Tokenizer, text: str) -> int | None:
    hf = getattr(tok, "hf", None)
    return None if hf is None else hf.token_to_id(text)


def find_fim_tokens(tok: Tokenizer) -> dict[str, int]:
    found = dict(getattr(tok, "fim_ids", None) or {})
    for kind, spellings in FIM_SPELLINGS.items():
        if kind in found:
            continue
        for text in spellings:
            token_id = _vocab_id(tok, text)
            if token_id is not None:
                found[kind] = token_id
                break
    return found


def fim_tokens(tok: Tokenizer, model_name: str, param: str) -> FimTokens:
    """The model's FIM tokens, or a 400 that names the missing ones."""
    found = find_fim_tokens(tok)
    missing = [name for kind, name in MISSING.items() if kind not in found]
    if missing:
        raise APIError(
            400,
            f"fill-in-the-middle is not supported by the model {model_name!r}: it has no "
            f"{', '.join(missing)} token (FIM needs a code model with FIM tokens, such as "
            "Qwen2.5-Coder)",
            param=param,
            code="fim_not_supported",
        )
    return FimTokens(**found)


def _adds_bos(tok: Tokenizer) -> bool:
    ids = tok.encode("", add_special=True)
    return bool(ids) and tok.bos_id is not None and ids[0] == tok.bos_id


def infill_ids(
    tok: Tokenizer,
    fim: FimTokens,
    prefix: str,
    suffix: str,
    extra: list[ExtraChunk],
    prompt: str,
    window: FimWindow,
) -> list[int]:
    """The prompt ids, token for token as llama.cpp's format_prompt_infill (not spm_infill):
    the code (prefix, suffix, extra files and their names) is text, special tokens' spellings in
    it included (a file may well hold "<|fim_prefix|>"); `prompt` reads them as tokens."""

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=False)

    extra_ids: list[int] = []
    if fim.rep is not None:
        extra_ids += [fim.rep, *encode(REPO_NAME + "\n")]
    for chunk in extra:
        if fim.sep is not None:
            extra_ids += [fim.sep, *encode(chunk.filename + "\n")]
        else:
            extra_ids += encode(CHUNK_SEPARATOR)
        extra_ids += encode(chunk.text)
    if fim.sep is not None:
        extra_ids += [fim.sep, *encode(CURRENT_FILE + "\n")]

    prefix_ids, suffix_ids = encode(prefix), encode(suffix)
    prompt_ids = tok.encode(prompt, add_special=False)
    n_batch = window.n_batch
    n_prefix_take = min(len(prefix_ids), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    n_extra_take = min(max(0, window.n_ctx - n_batch - 2 * window.n_predict), len(extra_ids))

    head = [tok.bos_id] if _adds_bos(tok) and tok.bos_id is not None else []
    kept_prefix = prefix_ids[len(prefix_ids) - n_prefix_take :]
    return [
        *extra_ids[len(extra_ids) - n_extra_take :],
        *head,
        fim.pre,
        *kept_prefix,
        *prompt_ids,
        fim.suf,
        *suffix_ids[:n_suffix_take],
        fim.mid,
    ]


def fim_window(n_ctx_seq: int, n_predict: int | None) -> FimWindow:
    """llama.cpp's window with its default batch (2048), at most half the context here: the
    rest stays for the extra chunks and the middle."""
    return FimWindow(min(2048, n_ctx_seq // 2), n_ctx_seq, -1 if n_predict is None else n_predict)
