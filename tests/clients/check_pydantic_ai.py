"""pydantic-ai: an agent with a tool and a typed output, by its default output tool and by NativeOutput
(response_format json_schema, where the model calls the tool first); each completes with a validated object and
no 400."""
import pydantic
from common import API_KEY, BASE_URL, MODEL, TOOL_PROMPT, case, finish
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import UsageLimits

model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=BASE_URL, api_key=API_KEY))
SETTINGS = ModelSettings(temperature=0, max_tokens=160, timeout=120)
LIMITS = UsageLimits(request_limit=8)


class Answer(pydantic.BaseModel):
    summary: str


def make(output_type, calls):
    a = Agent(model, output_type=output_type, instructions="Answer using the tools.", model_settings=SETTINGS,
              retries=3)

    # Offered until called once (pydantic-ai's prepare): given tools and a typed output the tiny model calls the
    # tool again and again; once it is gone, only the output remains.
    async def until_called(ctx, tool_def):
        return None if calls else tool_def

    @a.tool_plain(prepare=until_called)
    def lookup(function_name: str) -> str:
        """Look up a Python function's documentation."""
        calls.append(function_name)
        return "heappush(heap, item): push item onto heap, keeping the heap invariant."

    return a


@case
def output_tool():
    calls = []
    r = make(Answer, calls).run_sync(TOOL_PROMPT, usage_limits=LIMITS)
    # (the tiny model goes straight to the output tool here: any tool call is its choice)
    assert isinstance(r.output, Answer), r.output


@case
def native_output():
    calls = []
    r = make(NativeOutput(Answer), calls).run_sync(TOOL_PROMPT, usage_limits=LIMITS)
    assert calls, "the tool was not called"
    assert isinstance(r.output, Answer), r.output


@case
def plain_text():
    r = make(str, []).run_sync("Say hello.", usage_limits=LIMITS)
    assert isinstance(r.output, str), r.output


finish()
