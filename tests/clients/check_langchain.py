"""langchain-openai: ChatOpenAI plain and streamed, with_structured_output by json_schema and by
function_calling (validated objects), a tool call through bind_tools, and the legacy OpenAI().batch of two
prompts (one /v1/completions request with a list of prompts)."""
import pydantic
from common import API_KEY, BASE_URL, MODEL, NO_THINKING, TOOL_PROMPT, case, finish
from langchain_openai import ChatOpenAI, OpenAI


class City(pydantic.BaseModel):
    """A city."""
    name: str
    population: int


def chat(**kw):
    return ChatOpenAI(model=MODEL, base_url=BASE_URL, api_key=API_KEY, temperature=0, max_retries=0, timeout=120,
                      max_tokens=kw.pop("max_tokens", 96), **kw)


@case
def invoke_and_stream():
    m = chat(max_tokens=24)
    assert isinstance(m.invoke("Say hello.").content, str)
    parts = list(m.stream("Count to 3."))
    assert parts, "no chunks"


@case
def structured_json_schema():
    m = chat(extra_body=NO_THINKING).with_structured_output(City, method="json_schema")
    out = m.invoke("Describe a city.")
    assert isinstance(out, City), out


@case
def structured_function_calling():
    m = chat(extra_body=NO_THINKING).with_structured_output(City, method="function_calling")
    out = m.invoke("Describe a city.")
    assert isinstance(out, City), out


@case
def bind_tools_call():
    def lookup(function_name: str) -> str:
        """Look up a Python function's documentation."""
        return ""

    m = chat(extra_body=NO_THINKING).bind_tools([lookup], tool_choice="lookup")
    msg = m.invoke(TOOL_PROMPT)
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "lookup", msg
    assert isinstance(msg.tool_calls[0]["args"].get("function_name"), str), msg.tool_calls


@case
def legacy_batch():
    llm = OpenAI(model=MODEL, base_url=BASE_URL, api_key=API_KEY, temperature=0, max_tokens=8, max_retries=0)
    out = llm.batch(["Once upon a time", "The capital of France is"])
    assert len(out) == 2 and all(isinstance(s, str) for s in out), out


finish()
