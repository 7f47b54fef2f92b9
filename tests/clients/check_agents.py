"""OpenAI's Agents SDK on its default model (the Responses API): an agent with a function tool, run plain and
streamed, reaches a final answer; an agent with tools and an output_type calls the tool, then returns a
validated object; the same agent on the Chat Completions model."""
import asyncio

import pydantic
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                    set_default_openai_api, set_default_openai_client, set_tracing_disabled)
from common import API_KEY, BASE_URL, MODEL, TOOL_PROMPT, case, finish
from openai import AsyncOpenAI

client = AsyncOpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0, timeout=120)
set_default_openai_client(client, use_for_tracing=False)
set_default_openai_api("responses")
set_tracing_disabled(True)
# one event loop for every case: the client's connection pool belongs to the loop that first used it
LOOP = asyncio.new_event_loop()
calls = []


@function_tool
def lookup(function_name: str) -> str:
    """Look up a Python function's documentation."""
    calls.append(function_name)
    return "heappush(heap, item): push item onto heap, keeping the heap invariant."


# The same tool, offered until it has been called once (the SDK's is_enabled): with tools and an output_type
# the answer may be a tool call or the object, and the tiny model, given the choice, calls the tool again; once
# the tool is gone only the object remains.
@function_tool(name_override="lookup", is_enabled=lambda ctx, agent: not calls)
def lookup_once(function_name: str) -> str:
    """Look up a Python function's documentation."""
    calls.append(function_name)
    return "heappush(heap, item): push item onto heap, keeping the heap invariant."


class Answer(pydantic.BaseModel):
    summary: str


# tool_choice "required" makes the tiny model call the tool on the first turn; the SDK resets it after a call
# (reset_tool_choice), so the second turn can answer. max_tokens bounds each turn on the CPU.
SETTINGS = ModelSettings(temperature=0, tool_choice="required", max_tokens=160)


def agent(**kw):
    tools = [lookup_once] if "output_type" in kw else [lookup]
    return Agent(name="helper", instructions="Answer using the tools.", tools=tools, model=MODEL,
                 model_settings=SETTINGS, **kw)


@case
def responses_tool_then_answer():
    calls.clear()
    r = LOOP.run_until_complete(Runner.run(agent(), TOOL_PROMPT, max_turns=4))
    assert calls, "the tool was not called"
    assert isinstance(r.final_output, str), r.final_output


@case
def responses_streamed():
    calls.clear()

    async def go():
        r = Runner.run_streamed(agent(), TOOL_PROMPT, max_turns=4)
        kinds = set()
        async for e in r.stream_events():
            kinds.add(e.type)
        return r, kinds

    r, kinds = LOOP.run_until_complete(go())
    assert calls, "the tool was not called"
    assert "raw_response_event" in kinds, kinds
    assert isinstance(r.final_output, str), r.final_output


@case
def responses_tools_and_output_type():
    calls.clear()
    r = LOOP.run_until_complete(Runner.run(agent(output_type=Answer), TOOL_PROMPT, max_turns=4))
    assert calls, "the tool was not called"
    assert isinstance(r.final_output, Answer), r.final_output


@case
def chat_model_tools_and_output_type():
    calls.clear()
    a = agent(output_type=Answer)
    a.model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    r = LOOP.run_until_complete(Runner.run(a, TOOL_PROMPT, max_turns=4))
    assert calls, "the tool was not called"
    assert isinstance(r.final_output, Answer), r.final_output


finish()
