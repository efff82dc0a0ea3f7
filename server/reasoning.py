"""Reasoning models: the `<think>...</think>` part of a reply goes to `reasoning_content`.

A reply is split when it starts with `<think>` (DeepSeek-R1-distill, QwQ, Qwen3 with
enable_thinking) or when the rendered prompt already opened the block (a template whose
generation prompt ends with `<think>`): then everything up to `</think>` is reasoning.
Text that may be the start of a marker is held back while streaming, like a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt leaves the model inside a think block."""
    return prompt_text.rstrip().endswith(OPEN)


@dataclass(slots=True)
class Split:
    reasoning: str
    content: str


class ReasoningSplitter:
    def __init__(self, thinking: bool = False) -> None:
        self._state = "think" if thinking else "start"  # start -> think -> gap -> answer
        self._held = ""

    def feed(self, text: str) -> Split:
        buf, self._held = self._held + text, ""
        reasoning = content = ""
        while buf:
            if self._state == "start":
                head = buf.lstrip()
                if head.startswith(OPEN):
                    buf, self._state = head[len(OPEN) :], "think"
                elif OPEN.startswith(head):
                    self._held = buf  # may still be "<think>"
                    break
                else:
                    self._state = "answer"
            elif self._state == "think":
                end = buf.find(CLOSE)
                if end >= 0:
                    reasoning += buf[:end]
                    buf, self._state = buf[end + len(CLOSE) :], "gap"
                    continue
                keep = _partial(buf, CLOSE)
                reasoning += buf[: len(buf) - keep]
                self._held = buf[len(buf) - keep :]
                break
            elif self._state == "gap":  # newlines between </think> and the answer
                buf = buf.lstrip("\n")
                if buf:
                    self._state = "answer"
            else:
                content += buf
                break
        return Split(reasoning, content)

    def finish(self) -> Split:
        """Whatever is held: unclosed reasoning stays reasoning."""
        held, self._held = self._held, ""
        if self._state == "think":
            return Split(held, "")
        return Split("", held)


def split_reply(text: str, thinking: bool = False) -> Split:
    """A whole reply -> (reasoning, content)."""
    splitter = ReasoningSplitter(thinking)
    a, b = splitter.feed(text), splitter.finish()
    return Split(a.reasoning + b.reasoning, a.content + b.content)


def _partial(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
