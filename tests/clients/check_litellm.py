"""litellm against an OpenAI-compatible base URL: completion plain and streamed, a forced tool call, and a
json_schema response format (a validated object)."""
import json

import litellm
from common import API_KEY, BASE_URL, MODEL, NO_THINKING, TOOL_PROMPT, case, finish

litellm.telemetry = False
KW = dict(model="openai/" + MODEL, api_base=BASE_URL, api_key=API_KEY, temperature=0, num_retries=0, timeout=120)


@case
def completion_plain():
    r = litellm.completion(messages=[{"role": "user", "content": "Say hello."}], max_tokens=24, **KW)
    assert r.choices[0].finish_reason in ("stop", "length"), r
    assert r.usage.completion_tokens > 0


@case
def completion_stream():
    chunks = list(litellm.completion(messages=[{"role": "user", "content": "Count to 3."}], max_tokens=24,
                                     stream=True, **KW))
    assert chunks, "no chunks"


@case
def tool_call():
    tool = {"type": "function", "function": {
        "name": "lookup", "description": "Look up a Python function's documentation.",
        "parameters": {"type": "object", "properties": {"function_name": {"type": "string"}},
                       "required": ["function_name"]}}}
    r = litellm.completion(messages=[{"role": "user", "content": TOOL_PROMPT}], tools=[tool],
                           tool_choice={"type": "function", "function": {"name": "lookup"}}, max_tokens=96,
                           extra_body=NO_THINKING, **KW)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "lookup", r
    assert isinstance(json.loads(calls[0].function.arguments)["function_name"], str)


@case
def json_schema_format():
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["name", "population"], "additionalProperties": False}
    r = litellm.completion(messages=[{"role": "user", "content": "Describe a city as JSON."}], max_tokens=96,
                           response_format={"type": "json_schema",
                                            "json_schema": {"name": "city", "schema": schema, "strict": True}},
                           extra_body=NO_THINKING, **KW)
    out = json.loads(r.choices[0].message.content)
    assert isinstance(out["name"], str) and isinstance(out["population"], int), out


finish()
