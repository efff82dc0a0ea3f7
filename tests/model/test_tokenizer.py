"""Tokenizer and chat template of the GGUF against transformers' reading of the same file."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.model

HANDWRITTEN = [
    "",
    " ",
    "Hello world",
    " Hello  world ",
    "hello\n\nworld\n",
    "   leading and trailing   ",
    "\t\ttabs\tand\r\nCRLF\r\n",
    "\n\n\n\n",
    "naïve café résumé Ångström",
    "Привет, как дела?",
    "日本語のテキストと中文文本，还有한국어。",
    "emoji 😀👍🏽🎉 and family 👨‍👩‍👧‍👦 flag 🇫🇷",
    "math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = π",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a && b) { return c[i] >> 2; }",
    '<html><body class="x">&amp;</body></html>',
    "1234567890 3.14159 -42 1e-10 0x1F",
    "it's can't won't I'M YOU'LL we'd",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
    "<|im_start|><|im_start|>",
    "a <|im_start|> b",
    "<|im_start",
    "<filename>main.py<file_sep>",
    "ZWJ\u200dand\u00a0nbsp and \ufeffBOM",
    "   \n   \n",
    "x" * 300,
    "🙂" * 20,
    "ÀÁÂÃÄÅ àáâãäå",
    "Ελληνικά και עברית וعربي",
]
ALPHABET = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list(" \n\t  .,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`")
    + list("éüßñçøåœ中文字日本한국😀🎉👍€£¥→∞")
    + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "  ", "\n\n", "ing", " the"]
)


def varied_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60))) for _ in range(n)]


STRINGS = HANDWRITTEN + varied_strings(200)


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm.tokenizer


def test_ids_match_transformers_without_digits(tok, hf_tokenizer):
    plain = ["".join(c for c in s if not c.isdigit()) for s in STRINGS]
    mismatches = [s for s in plain if tok.encode(s) != hf_tokenizer.encode(s)]
    assert not mismatches, mismatches[:5]


def test_ids_match_transformers_with_smollm_digit_split(tok, hf_tokenizer):
    """GGUF `tokenizer.ggml.pre = smollm` splits digits one by one before GPT-2's regex
    (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM, and SmolLM2's own tokenizer.json:
    Digits(individual_digits) + ByteLevel); transformers' GGUF converter drops that step,
    so the reference gets SmolLM2's published pre-tokenizer back."""
    from tokenizers import pre_tokenizers

    assert len(STRINGS) >= 200
    assert tok.encode("x  4") != hf_tokenizer.encode("x  4")  # the converter's known loss
    reference = hf_tokenizer.backend_tokenizer
    original = reference.pre_tokenizer
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), original]
    )
    try:
        mismatches = [s for s in STRINGS if tok.encode(s) != hf_tokenizer.encode(s)]
    finally:
        reference.pre_tokenizer = original
    assert not mismatches, mismatches[:5]


def test_special_tokens_written_in_text_are_single_ids(tok):
    im_start = tok.encode("<|im_start|>")
    assert im_start == [1] and tok.id_to_token(1) == "<|im_start|>"
    assert tok.encode("a<|im_end|>b") == tok.encode("a") + [2] + tok.encode("b")


def test_decode_is_lossless(tok):
    for s in STRINGS:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert b"".join(tok.token_bytes(i) for i in ids) == s.encode()


def test_token_bytes_split_a_multibyte_char(tok):
    ids = tok.encode("😀")
    parts = [tok.token_bytes(i) for i in ids]
    assert len(ids) > 1 and b"".join(parts) == "😀".encode()


def test_skip_special_drops_control_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "user\nhi"


def test_eos_ids_and_bos(tok, hf_tokenizer):
    assert hf_tokenizer.eos_token_id in tok.eos_ids
    assert tok.token_bytes(2) == b"<|im_end|>"
    assert tok.bos_id == 1 and tok.vocab_size == 49152


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 日本語 😀"},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second\n\nwith lines"},
        {"role": "user", "content": ""},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(smollm, hf_tokenizer, add_generation_prompt):
    for messages in CONVERSATIONS:
        ours = smollm.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        ref = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == ref
    assert smollm.chat_template is not None


def test_system_prefix_is_a_token_prefix(smollm):
    messages = CONVERSATIONS[2]
    prefix = smollm.chat_template.system_prefix(messages)
    assert prefix == "<|im_start|>system\nBe brief.<|im_end|>\n"
    full = smollm.tokenizer.encode(smollm.chat_template.render(messages))
    n_keep = len(smollm.tokenizer.encode(prefix))
    assert full[:n_keep] == smollm.tokenizer.encode(prefix)
    assert smollm.chat_template.system_prefix(CONVERSATIONS[0]) == ""
