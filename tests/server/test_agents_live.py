"""The OpenAI Agents SDK (openai-agents, test-only) against /v1/responses with the real model:
an agent with one function tool calls it and completes its run."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.model


def test_an_agent_with_a_function_tool_completes_a_run(live_server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # nothing may leave the machine
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    async def run():
        client = AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0)
        model = (await client.models.list()).data[0].id
        agent = agents.Agent(
            name="weather",
            instructions="You answer questions about the weather. Use the get_weather tool.",
            tools=[get_weather],
            model=agents.OpenAIResponsesModel(model, client),
            # NOTE: "required" for the first turn (the SDK resets it to auto after a call,
            # reset_tool_choice): a 135M model would not reliably choose to call on its own
            model_settings=agents.ModelSettings(
                tool_choice="required", temperature=0.0, max_tokens=96
            ),
        )
        return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    assert calls, "the tool was not called"
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert outputs and "sunny" in str(outputs[0].output)
    assert isinstance(result.final_output, str) and result.final_output.strip()
