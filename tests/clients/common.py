"""Shared by the check_<client>.py scripts: where the server is, and a small case runner."""
import os
import sys
import time
import traceback

BASE_URL = os.environ["TANSY_BASE_URL"]  # http://127.0.0.1:PORT/v1
API_KEY = os.environ["TANSY_API_KEY"]
MODEL = os.environ["TANSY_MODEL_NAME"]
# A prompt the bundled tiny model answers with a tool call (it was trained on tool round trips like it).
TOOL_PROMPT = "Use a tool to find out what heapq.heappush does."
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

_failed = []


def case(fn):
    """Runs fn() as one named case; a failure is reported and counted, and the next case runs."""
    t0 = time.time()
    try:
        fn()
        print(f"  ok    {fn.__name__} ({time.time() - t0:.1f} s)", flush=True)
    except Exception:  # noqa: BLE001 - every failure is reported
        _failed.append(fn.__name__)
        print(f"  FAIL  {fn.__name__} ({time.time() - t0:.1f} s)", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
    return fn


def finish():
    if _failed:
        print(f"{len(_failed)} case(s) failed: {', '.join(_failed)}", flush=True)
        sys.exit(1)
    print("all cases passed", flush=True)
