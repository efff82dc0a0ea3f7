"""Request fields that would change the output and that cellserve does not implement: a 400
naming the field, never a silent ignore. Fields that do not change the output (`user`,
`metadata`, `store: false`, `service_tier`, ...) are accepted; docs/api.md lists both."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from server.errors import APIError
from server.schemas import ChatMessage

# field -> (is it asking for something unsupported?, why it is refused)
Rule = tuple[Callable[[Any, BaseModel], bool], str]


def given(value: Any, _: BaseModel) -> bool:
    return value is not None and value is not False and value != [] and value != {}


def _not_text_only(value: Any, _: BaseModel) -> bool:
    return value is not None and (not isinstance(value, list) or set(value) - {"text"} != set())


def _best_of_above_n(value: Any, body: BaseModel) -> bool:
    return value is not None and value != getattr(body, "n", 1)


_COMMON: dict[str, Rule] = {
    "logits_processors": (given, "custom logits processors are not supported"),
    "store": (given, "store: true is not supported: this server keeps no completions"),
}
CHAT_RULES: dict[str, Rule] = {
    **_COMMON,
    "audio": (given, "audio output is not supported: this server generates text only"),
    "modalities": (_not_text_only, "only the 'text' output modality is supported"),
    "prediction": (given, "predicted outputs are not supported"),
    "web_search_options": (given, "web search is not supported"),
}
COMPLETION_RULES: dict[str, Rule] = {
    **_COMMON,
    "best_of": (_best_of_above_n, "best_of other than n is not supported"),
}

EMBEDDING_RULES: dict[str, Rule] = {
    "truncate_prompt_tokens": (given, "truncating inputs is not supported"),
}


def reject_unsupported(body: BaseModel, rules: dict[str, Rule]) -> None:
    """400 on the first field of `body` (declared or extra) that `rules` refuses."""
    extra = body.model_extra or {}
    for name, (refused, why) in rules.items():
        value = extra[name] if name in extra else getattr(body, name, None)
        if refused(value, body):
            raise APIError(400, f"{name}: {why}", param=name, code="unsupported_parameter")


def reject_non_text_messages(messages: list[ChatMessage]) -> None:
    """400 on a content part that is not text (images, audio, files): the model reads text."""
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type != "text":
                raise APIError(
                    400,
                    f"messages.{i}.content.{j}: content parts of type {part.type!r} are not "
                    "supported: this model reads text only",
                    param=f"messages.{i}.content.{j}.type",
                    code="unsupported_content",
                )
