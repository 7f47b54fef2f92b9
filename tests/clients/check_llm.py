"""Simon Willison's `llm` CLI with the server registered as an OpenAI-compatible model (extra-openai-models.yaml
in LLM_USER_PATH): a plain prompt, and `--schema` output that validates against the schema."""
import json
import os
import subprocess
import sys

from common import API_KEY, BASE_URL, MODEL, case, finish

home = os.environ["LLM_USER_PATH"]
os.makedirs(home, exist_ok=True)
with open(os.path.join(home, "extra-openai-models.yaml"), "w") as f:
    f.write(f"- model_id: tansy\n  model_name: {MODEL}\n  api_base: \"{BASE_URL}\"\n  api_key_name: tansy\n"
            "  supports_schema: true\n  supports_tools: true\n")
with open(os.path.join(home, "keys.json"), "w") as f:
    json.dump({"tansy": API_KEY}, f)
LLM = [os.path.join(os.path.dirname(sys.executable), "llm"), "-m", "tansy", "--no-log"]


def run(*args):
    r = subprocess.run(LLM + list(args), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"llm exited {r.returncode}: {r.stderr}"
    return r.stdout


@case
def plain_prompt():
    out = run("-o", "temperature", "0", "-o", "max_tokens", "24", "Say hello.")
    assert isinstance(out, str)


@case
def schema_output():
    out = run("--schema", "name, population int", "-o", "temperature", "0", "-o", "max_tokens", "128",
              "Describe a city.")
    obj = json.loads(out)
    assert isinstance(obj.get("name"), str) and isinstance(obj.get("population"), int), out


finish()
