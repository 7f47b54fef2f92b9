"""pydantic-ai: an agent with a tool and a typed output, by its default output tool and by NativeOutput
(response_format json_schema); each completes with a validated object and no 400."""
import pydantic
from common import API_KEY, BASE_URL, MODEL, TOOL_PROMPT, case, finish
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=BASE_URL, api_key=API_KEY))
SETTINGS = ModelSettings(temperature=0, max_tokens=160, timeout=120)


class Answer(pydantic.BaseModel):
    summary: str


def make(output_type):
    a = Agent(model, output_type=output_type, instructions="Answer using the tools.", model_settings=SETTINGS,
              retries=3)

    @a.tool_plain
    def lookup(function_name: str) -> str:
        """Look up a Python function's documentation."""
        return "heappush(heap, item): push item onto heap, keeping the heap invariant."

    return a


@case
def output_tool():
    r = make(Answer).run_sync(TOOL_PROMPT)
    assert isinstance(r.output, Answer), r.output


@case
def native_output():
    r = make(NativeOutput(Answer)).run_sync(TOOL_PROMPT)
    assert isinstance(r.output, Answer), r.output


@case
def plain_text():
    r = make(str).run_sync("Say hello.")
    assert isinstance(r.output, str), r.output


finish()
