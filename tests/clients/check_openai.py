"""The official openai SDK: chat completions (plain, streamed, parse with a pydantic model, a strict function
tool), the Responses API (plain, streamed, a function-tool round trip, parse), legacy completions in a batch."""
import json

import openai
import pydantic
from common import API_KEY, BASE_URL, MODEL, NO_THINKING, TOOL_PROMPT, case, finish

client = openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0, timeout=120)


class City(pydantic.BaseModel):
    name: str
    population: int
    coastal: bool


class Lookup(pydantic.BaseModel):
    """Look up a Python function's documentation."""
    function_name: str


@case
def chat_plain():
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length"), r
    assert r.usage.completion_tokens > 0


@case
def chat_stream():
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to 3."}],
                                                 max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


@case
def chat_parse_pydantic():
    r = client.chat.completions.parse(model=MODEL, temperature=0, max_tokens=96, extra_body=NO_THINKING,
                                      messages=[{"role": "user", "content": "Describe a city as JSON."}],
                                      response_format=City)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(msg.parsed, City), msg


@case
def chat_parse_strict_tool():
    r = client.chat.completions.parse(model=MODEL, temperature=0, max_tokens=96, extra_body=NO_THINKING,
                                      messages=[{"role": "user", "content": TOOL_PROMPT}],
                                      tools=[openai.pydantic_function_tool(Lookup)],
                                      tool_choice={"type": "function", "function": {"name": "Lookup"}})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls", r
    assert calls and isinstance(calls[0].function.parsed_arguments, Lookup), calls


TOOL = {"type": "function", "name": "lookup", "description": "Look up a Python function's documentation.",
        "parameters": {"type": "object", "properties": {"function_name": {"type": "string"}},
                       "required": ["function_name"], "additionalProperties": False}, "strict": True}


@case
def responses_plain():
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=32, temperature=0,
                                reasoning={"effort": "none"})
    assert r.status in ("completed", "incomplete"), r
    assert r.usage.output_tokens > 0
    assert r.output, r


@case
def responses_stream():
    kinds = [e.type for e in client.responses.create(model=MODEL, input="Count to 3.", max_output_tokens=32,
                                                     temperature=0, stream=True)]
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds, kinds


@case
def responses_tool_round_trip():
    r = client.responses.create(model=MODEL, input=TOOL_PROMPT, tools=[TOOL], tool_choice="required",
                                max_output_tokens=128, temperature=0, reasoning={"effort": "none"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls, r.output
    args = json.loads(calls[0].arguments)
    assert isinstance(args.get("function_name"), str), args
    follow = [{"role": "user", "content": TOOL_PROMPT}, calls[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": calls[0].call_id,
               "output": "heappush(heap, item): push item onto heap, keeping the heap invariant."}]
    r2 = client.responses.create(model=MODEL, input=follow, tools=[TOOL], max_output_tokens=64, temperature=0,
                                 reasoning={"effort": "none"})
    assert r2.status in ("completed", "incomplete"), r2
    assert r2.output, r2


@case
def responses_parse():
    r = client.responses.parse(model=MODEL, input="Describe a city as JSON.", text_format=City, temperature=0,
                               max_output_tokens=96, reasoning={"effort": "none"})
    assert isinstance(r.output_parsed, City), r


@case
def completions_batch():
    r = client.completions.create(model=MODEL, prompt=["Once upon a time", "The capital of France is"],
                                  max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1], r


finish()
