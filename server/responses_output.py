"""The Response object of /v1/responses, built from the chat pipeline's reply: reasoning,
message and function_call output items, status, usage, and the request's settings echoed."""

from __future__ import annotations

import uuid
from typing import Any

from server.generation import Generation
from server.schemas_out import AssistantMessage
from server.schemas_responses import ResponsesRequest
from server.schemas_responses_out import (
    FunctionCall,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    Status,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> Status:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponseBuilder:
    def __init__(self, body: ResponsesRequest, resp_id: str, created: int, model: str) -> None:
        self.body = body
        self.resp_id = resp_id
        self.created = created
        self.model = model

    def response(
        self,
        status: Status,
        output: list[OutputItem],
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        body = self.body
        text: dict[str, Any] = {"format": {"type": "text"}}
        if body.text is not None and body.text.format is not None:
            text = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
        incomplete = None
        if status == "incomplete":
            incomplete = IncompleteDetails(reason="max_output_tokens")
        return ResponseObject(
            id=self.resp_id,
            created_at=self.created,
            status=status,
            error=error,
            incomplete_details=incomplete,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.model,
            output=output,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            reasoning=body.model_extra.get("reasoning") if body.model_extra else None,
            temperature=body.temperature,
            text=text,
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            top_p=body.top_p,
            usage=usage,
            user=body.user,
            metadata=body.metadata or {},
        )

    def final(
        self, output: list[OutputItem], reason: str | None, gen: Generation
    ) -> ResponseObject:
        num_input, num_output, num_cached = gen.usage()
        usage = ResponseUsage.of(num_input, num_output, num_cached)
        return self.response(status_of(reason), output, usage)

    def whole(self, message: AssistantMessage, reason: str, gen: Generation) -> ResponseObject:
        """The response to a finished reply (`reason`: its finish_reason, after tool parsing)."""
        status = status_of(reason)
        output: list[OutputItem] = []
        if message.reasoning_content:
            text = ReasoningText(text=message.reasoning_content)
            output.append(ReasoningItem(id=new_id("rs"), content=[text], status=status))
        if message.content or not message.tool_calls:
            text_part = OutputText(text=message.content or "")
            output.append(OutputMessage(id=new_id("msg"), status=status, content=[text_part]))
        for call in message.tool_calls or []:
            output.append(
                FunctionCall(
                    id=new_id("fc"),
                    call_id=call.id,
                    name=call.function.name,
                    arguments=call.function.arguments,
                    status="completed",
                )
            )
        return self.final(output, reason, gen)
