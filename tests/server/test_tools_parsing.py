"""Tool calls, reasoning and the template side of tools, without a model: parsers per
family, the streaming splitters, the assistant message, and what the template renders."""

from __future__ import annotations

import json

import pytest

from model.load.chat_template import ChatTemplate
from model.load.tool_prompt import HERMES, LLAMA3, MISTRAL, tool_format
from server.chat_reply import ReplyOptions, ReplyStream, whole_reply
from server.reasoning import ReasoningSplitter, split_reply
from server.schemas_tools import NamedToolChoice, Tool
from server.structured import tool_grammar_spec
from server.tool_parsers import ToolCallStream, parse_reply

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SMOL = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# a Qwen-2.5-like template that renders tools and tool turns itself
QWENISH = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>"
    "{% endfor %}\n{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}no-think\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (HERMES, f"<tool_call>\n{CALL}\n</tool_call>"),
        (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
        (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
        (MISTRAL, f"[TOOL_CALLS] [{CALL}]"),
        (MISTRAL, f"[{CALL}]"),
    ],
)
def test_each_family_parses_its_calls(fmt: str, text: str) -> None:
    reply = parse_reply(text, fmt)
    assert reply.content is None
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert reply.tool_calls[0].id.startswith("call_")


def test_hermes_keeps_the_text_before_calls_and_reads_several() -> None:
    reply = parse_reply(
        f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>",
        HERMES,
    )
    assert reply.content == "Let me check."
    assert len(reply.tool_calls) == 2 and reply.tool_calls[0].id != reply.tool_calls[1].id


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (HERMES, "<tool_call>\n{not json}\n</tool_call>"),
        (HERMES, "Paris is sunny."),
        (LLAMA3, "{ this is prose in braces }"),
        (MISTRAL, "[1, 2]"),
    ],
)
def test_a_reply_whose_calls_do_not_parse_stays_content(fmt: str, text: str) -> None:
    assert parse_reply(text, fmt).content == text
    assert parse_reply(text, fmt).tool_calls == []


def test_a_call_cut_by_max_tokens_is_dropped_after_complete_ones() -> None:
    reply = parse_reply(f'<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{"na', HERMES)
    assert [c.name for c in reply.tool_calls] == ["get_weather"]


def test_tool_call_stream_streams_content_then_holds_the_call() -> None:
    stream = ToolCallStream(HERMES)
    pieces = [stream.feed(t) for t in ["Sure", ". <to", "ol_call>\n", CALL, "\n</tool_call>"]]
    assert "".join(pieces) == "Sure. "
    rest, calls = stream.finish()
    assert rest == "" and calls[0].name == "get_weather"
    plain = ToolCallStream(LLAMA3)
    assert "".join(plain.feed(t) for t in [" ", "Hi", "!"]) + plain.finish()[0] == " Hi!"


def test_reasoning_is_split_whole_and_streamed_char_by_char() -> None:
    text = "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4."
    whole = split_reply(text)
    assert (whole.reasoning, whole.content) == ("\nThe user wants 2+2.\n", "It is 4.")
    splitter = ReasoningSplitter()
    parts = [splitter.feed(ch) for ch in text] + [splitter.finish()]
    assert "".join(p.reasoning for p in parts) == whole.reasoning
    assert "".join(p.content for p in parts) == whole.content
    assert split_reply("just thinking", thinking=True).reasoning == "just thinking"
    assert split_reply("no think tags").content == "no think tags"


def test_whole_reply_and_stream_agree_on_tool_calls_and_finish_reason() -> None:
    opts = ReplyOptions(tool_format=HERMES, parallel_tool_calls=False)
    block = f"<tool_call>\n{CALL}\n</tool_call>"
    text = f"<think>call it</think>{block}\n{block}"
    message, reason = whole_reply(text, "stop", opts)
    assert reason == "tool_calls" and message.content is None
    assert message.reasoning_content == message.reasoning == "call it"
    assert message.tool_calls is not None and len(message.tool_calls) == 1  # parallel off
    stream = ReplyStream(opts)
    deltas = [d for ch in text for d in stream.feed(ch)]
    last, s_reason = stream.finish("stop")
    calls = [tc for d in deltas + last for tc in d.tool_calls or []]
    assert s_reason == "tool_calls"
    assert calls[0].id and calls[0].function.name == "get_weather"  # id + name first
    assert calls[1].id is None and json.loads(calls[1].function.arguments or "") == {
        "city": "Paris"
    }
    assert "".join(d.reasoning_content or "" for d in deltas) == "call it"
    assert whole_reply(text, "length", opts)[1] == "length"


def test_template_formats_are_detected() -> None:
    assert tool_format(SMOL) == HERMES  # no tools: cellserve renders them the Hermes way
    assert tool_format("{{ tools }} <tool_call>") == HERMES
    assert tool_format("{{ tools }} <|python_tag|> ipython") == LLAMA3
    assert tool_format("{{ tools }} [TOOL_CALLS]") == MISTRAL


def test_a_template_without_tools_gets_them_hermes_style() -> None:
    rendered = ChatTemplate(SMOL).render(HISTORY, tools=[WEATHER])
    assert rendered.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER) in rendered
    assert rendered.endswith(
        f"<|im_start|>assistant\n<tool_call>\n{CALL}\n</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_a_template_with_tools_gets_them_and_the_kwargs() -> None:
    template = ChatTemplate(QWENISH)
    rendered = template.render(HISTORY, tools=[WEATHER], enable_thinking=False)
    assert rendered == (
        "TOOLS:get_weather;user: Weather in Paris?\n"  # trim_blocks, as transformers renders
        '<tool_call>get_weather {"city": "Paris"}</tool_call>'
        '<tool_response>{"temp": 21}</tool_response>\nno-think\n'
    )
    assert "no-think" not in template.render(HISTORY, tools=[WEATHER])
    # chat_template_kwargs cannot override what the renderer sets
    assert ChatTemplate("{{ bos_token }}", bos_token="<s>").render([], bos_token="X") == "<s>"


def test_tool_grammars_per_choice() -> None:
    tools = [Tool.model_validate(WEATHER)]
    assert tool_grammar_spec(tools, "auto", True, HERMES) is None
    assert tool_grammar_spec(tools, "none", True, HERMES) is None
    required = tool_grammar_spec(tools, "required", True, HERMES)
    assert required is not None and required[1] == "tools"
    assert '"<tool_call>\\n"' in required[0].source and '"\\n"?' in required[0].source
    named = tool_grammar_spec(
        tools, NamedToolChoice.model_validate({"function": {"name": "get_weather"}}), True, MISTRAL
    )
    assert named is not None and '"maxItems": 1' in named[0].source
    strict = [Tool.model_validate({**WEATHER, "function": {**WEATHER["function"], "strict": True}})]
    auto_strict = tool_grammar_spec(strict, "auto", True, HERMES)
    assert auto_strict is not None and "TEXT" in auto_strict[0].source
