"""Structured outputs: a request's compiled grammar and each choice's matcher over it.

The matcher is llguidance's (Rust, no torch): the worker asks it for the next token's bitmask,
the scheduler advances it with the sampled token.

NOTE: invariant: a sequence's matcher has consumed exactly its `output_ids` (a final stop token
aside). Preemption and context shift change neither, so the matcher survives them untouched
(the tokens it accepted stay accepted; nothing is replayed); the prefix cache only serves
prompts; an n > 1 fork copies its parent's matcher (`deep_copy`) as it shares its parent's
cells.
"""

from __future__ import annotations

from dataclasses import dataclass

from llguidance import LLMatcher


@dataclass(slots=True, frozen=True, eq=False)
class Grammar:
    """A compiled grammar; one object serves every request that asks for the same grammar."""

    kind: str  # "json_schema" | "regex" | "lark" | "gbnf" | "choice" (model/runner/grammar.py)
    source: str  # the text it was compiled from (the compile cache's key)
    matcher: LLMatcher  # at the start state, never advanced: the template of every constraint

    def new_constraint(self) -> Constraint:
        return Constraint(self.matcher.deep_copy())


@dataclass(slots=True, eq=False)
class Constraint:
    """One choice's position in its grammar."""

    matcher: LLMatcher

    def fork(self) -> Constraint:
        return Constraint(self.matcher.deep_copy())

    def advance(self, token: int) -> str | None:
        """Consumes a sampled token; -> None, or why the grammar rejected it (the matcher is
        then in its error state for good)."""
        if self.matcher.consume_token(token):
            return None
        return f"the grammar rejected token {token}: {self.matcher.get_error()}"

    @property
    def is_done(self) -> bool:
        """The grammar is complete and admits nothing more (EOS aside): the choice stops."""
        return self.matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()
