"""Workloads: sessions of user turns built from random words of a target token length.

Every workload is a list of `Session`s. A session is one system prompt (may be empty) and
one or more user turns sent one after another, each resending the growing history
(multi-turn); `random` and `shared-prefix` sessions have a single turn. `code-edit` asks to
rename a variable in a generated Python function of about input_len tokens and return the whole
function: an answer that repeats most of its prompt (speculative decoding's case; send it to
the chat endpoint without ignore_eos).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import httpx

WORKLOADS = ("random", "shared-prefix", "multi-turn", "code-edit")

# Plain lowercase words: most are one token in BPE vocabularies, which keeps the
# calibration short. Immutable on purpose.
_WORD_TEXT = """
    time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot
    right study book eye job word business issue side kind head house service friend father
    power hour game line end member law car city community name president team minute idea
    kid body information back parent face others level office door health person art war
    history party result change morning reason research girl guy moment air teacher force
    education foot boy age policy music market sense nation plan college interest death
    experience effect use class control care field development role effort rate heart drug
    show leader light voice wife police mind price report decision son view relationship town
    road arm difference value building action model season society tax director position
    player record paper space ground form event official matter center couple site project
    activity star table need court oil situation cost industry figure street image phone data
    picture practice piece land product doctor wall patient worker news test movie north love
    support technology step baby computer type attention film tree source organization hair
    window evidence population river garden stone bridge cloud summer winter spring
    """
WORDS = tuple(_WORD_TEXT.split())
TOKENS_PER_WORD_GUESS = 1.0  # common words with a leading space: one BPE token each, mostly

CountFn = Callable[[str], int]


@dataclass(slots=True)
class Session:
    system: str
    user_turns: list[str]
    system_tokens: int  # as counted by the server's /tokenize, or estimated
    turn_tokens: list[int]


@dataclass(slots=True)
class WorkloadSpec:
    name: str = "random"
    num_prompts: int = 32  # sessions; multi-turn sends num_prompts * turns requests
    input_len: int = 256  # tokens per user turn (the suffix for shared-prefix)
    prefix_len: int = 1000  # shared system prompt, shared-prefix only
    turns: int = 3  # multi-turn only

    def num_requests(self) -> int:
        return self.num_prompts * (self.turns if self.name == "multi-turn" else 1)


class PromptBuilder:
    """Random-word texts calibrated to a token count with the server's tokenizer if given."""

    def __init__(self, rng: random.Random, count_tokens: CountFn | None = None) -> None:
        self.rng = rng
        self.count_tokens = count_tokens
        self.tokens_per_word = TOKENS_PER_WORD_GUESS

    def text(self, n_tokens: int) -> tuple[str, int]:
        """(text, its token count); the count is exact when a tokenizer is available."""
        n_words = max(1, round(n_tokens / self.tokens_per_word))
        words = [self.rng.choice(WORDS) for _ in range(n_words)]
        if self.count_tokens is None:
            return " ".join(words), round(n_words * self.tokens_per_word)
        best: tuple[int, str, int] | None = None
        for _ in range(6):
            while len(words) < n_words:
                words.append(self.rng.choice(WORDS))
            text = " ".join(words[:n_words])
            count = self.count_tokens(text)
            if best is None or abs(count - n_tokens) < best[0]:
                best = (abs(count - n_tokens), text, count)
            if count == n_tokens:
                break
            self.tokens_per_word = max(0.5, count / n_words)
            step = round((n_tokens - count) / self.tokens_per_word)
            n_words = max(1, n_words + (step or (1 if count < n_tokens else -1)))
        assert best is not None
        return best[1], best[2]


_STATEMENTS = (
    "{a} = {b} * {n} + {c}",
    "if {a} > {n}:\n        {b} = {b} - {a}",
    "{a} = sorted({b}, key=lambda item: item[{n}])",
    "for {a} in range({n}):\n        {b} += {a} * {c}",
    "{a} = [value * {n} for value in {b} if value]",
    "while {a} < {n}:\n        {a} += {c}",
    "{a} = dict(zip({b}, {c}))",
    "{a} = max({b}, {c}, {n})",
)


def code_edit_turn(rng: random.Random, n_tokens: int) -> tuple[str, str, str]:
    """(the request, the old name, the new name): a Python function of about `n_tokens`
    tokens (~4 characters a token) and the instruction to rename one of its variables."""
    names = rng.sample(WORDS, 6)
    body = [f"    {name} = {rng.randrange(2, 99)}" for name in names[:3]]
    while sum(len(line) for line in body) < 4 * n_tokens:
        a, b, c = (rng.choice(names) for _ in range(3))
        line = rng.choice(_STATEMENTS).format(a=a, b=b, c=c, n=rng.randrange(2, 99))
        body.append("    " + line)
    old = names[0]
    new = f"{old}_{rng.choice(WORDS)}"
    head = f"def compute_{names[4]}_{names[5]}({names[1]}, {names[2]}):"
    code = "\n".join([head, *body, f"    return {old}"])
    prompt = (
        f"Rename the variable `{old}` to `{new}` in this Python function. Reply with the "
        f"whole updated function in one code block and nothing else.\n\n```python\n{code}\n```"
    )
    return prompt, old, new


def build_sessions(
    spec: WorkloadSpec, builder: PromptBuilder, system: tuple[str, int] | None = None
) -> list[Session]:
    """`system` (text, tokens) overrides the shared-prefix system prompt built here."""
    if spec.name not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.name!r}; choose from {WORKLOADS}")
    system_text, system_tokens = "", 0
    if spec.name == "shared-prefix":
        system_text, system_tokens = system or builder.text(spec.prefix_len)
    n_turns = spec.turns if spec.name == "multi-turn" else 1
    sessions = []
    for _ in range(spec.num_prompts):
        if spec.name == "code-edit":
            text = code_edit_turn(builder.rng, spec.input_len)[0]
            count = builder.count_tokens(text) if builder.count_tokens else len(text) // 4
            sessions.append(Session("", [text], 0, [count]))
            continue
        turns = [builder.text(spec.input_len) for _ in range(n_turns)]
        sessions.append(
            Session(system_text, [t for t, _ in turns], system_tokens, [n for _, n in turns])
        )
    return sessions


def server_token_counter(client: httpx.Client, model: str) -> CountFn | None:
    """A counter backed by the server's POST /tokenize, or None when it has none.

    Sends both `prompt` (cellserve, vLLM) and `content` (llama.cpp's server); reads `count`
    or the length of `tokens`. `client` has the server's root URL as base_url.
    """

    def count(text: str) -> int:
        resp = client.post("/tokenize", json={"model": model, "prompt": text, "content": text})
        resp.raise_for_status()
        body = resp.json()
        if isinstance(body.get("count"), int):
            return int(body["count"])
        return len(body["tokens"])

    try:
        count("hello world")
    except (httpx.HTTPError, KeyError, TypeError, ValueError, AttributeError):
        return None
    return count
