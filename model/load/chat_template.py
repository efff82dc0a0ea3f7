"""The model's own Jinja chat template, rendered like transformers' apply_chat_template."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model.errors import ModelLoadError
from model.load.tool_prompt import arguments_as_objects, hermes_messages, tool_format

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# names the renderer sets itself; chat_template_kwargs may not override them
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def read_template(value: str) -> str:
    """--chat-template: a path to a Jinja file, or the template itself (it has {{ or {%)."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ModelLoadError(
            f"--chat-template {value!r} is neither a file nor a Jinja template "
            "(a template contains {{ ... }} or {% ... %})."
        )
    return path.read_text()


class ChatTemplate:
    """A model's chat template; models without one get no ChatTemplate at all (the server
    then answers /v1/chat/completions with 400 and points at --chat-template)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except TemplateError as e:
            raise ModelLoadError(f"the model's chat template does not parse ({e}).") from e

    @property
    def supports_tools(self) -> bool:
        """The template renders `tools` itself (else model.load.tool_prompt does, Hermes style)."""
        return "tools" in self.source

    @property
    def tool_format(self) -> str:
        """The format its model writes tool calls in (model.load.tool_prompt: hermes, llama3,
        mistral)."""
        return tool_format(self.source)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Like transformers' apply_chat_template(tokenize=False): `tools` (OpenAI's list of
        {"type": "function", "function": {...}}) and `kwargs` (chat_template_kwargs, such as
        enable_thinking) reach the template. Raises jinja2.TemplateError when the template
        rejects the conversation."""
        messages = arguments_as_objects(messages)
        has_tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if not self.supports_tools and (tools or has_tool_turns):
            messages, tools = hermes_messages(messages, tools), None
        extra = {k: v for k, v in kwargs.items() if k not in RESERVED}
        return self._template.render(
            messages=messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def system_prefix(self, messages: list[dict[str, Any]]) -> str:
        """The rendering of the leading system message(s) alone when it is a prefix of the full
        rendering (so its token count is a safe n_keep for context shift), else ""."""
        n_system = 0
        while n_system < len(messages) and messages[n_system].get("role") == "system":
            n_system += 1
        if n_system == 0:
            return ""
        try:
            prefix = self.render(messages[:n_system], add_generation_prompt=False)
            full = self.render(messages, add_generation_prompt=True)
        except TemplateError:
            return ""
        return prefix if full.startswith(prefix) else ""
