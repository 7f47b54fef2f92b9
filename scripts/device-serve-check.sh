#!/usr/bin/env bash
# Checks `tansy serve` end to end on the GPU machine, after scripts/device.sh has built build-dev:
# starts the server on the bundled tiny model (port 0, loopback), waits for /health, sends one non-streaming and
# one streaming greedy chat completion (python3's urllib only) for a fixed prompt with max_tokens 32, checks the
# streamed text equals the non-streamed one and both equal `tansy run`'s greedy output for the same prompt, then
# stops the server. Prints PASS or FAIL; exits non-zero on failure.
#   scripts/device-serve-check.sh [cuda|cpu]      (or BACKEND=cpu; default cuda)
#   TANSY=build/bin/tansy scripts/device-serve-check.sh cpu     (another binary; default build-dev/bin/tansy)
#   MODEL=DIR, PROMPT=TEXT, N=32, THREADS=N (CPU threads for both server and run; default 1 on cpu)
set -uo pipefail
cd "$(dirname "$0")/.."
backend=${1:-${BACKEND:-cuda}}
[ -d .carry/deps/lib ] && export LD_LIBRARY_PATH=$PWD/.carry/deps/lib:${LD_LIBRARY_PATH:-}
threads=${THREADS:-}; [ -z "$threads" ] && [ "$backend" = cpu ] && threads=1
export DSC_TANSY=${TANSY:-build-dev/bin/tansy} DSC_BACKEND=$backend DSC_MODEL=${MODEL:-models/tiny-chat-q4} \
  DSC_PROMPT=${PROMPT:-Write a haiku about rain.} DSC_N=${N:-32} DSC_THREADS=$threads
[ -x "$DSC_TANSY" ] || { echo "device-serve-check: FAIL: no $DSC_TANSY (build it first)"; exit 2; }
ldd "$DSC_TANSY" 2>/dev/null | grep -E 'not found|pcre2|utf8proc' | sed 's/^[[:space:]]*/ldd: /'
exec python3 - <<'EOF'
import json, os, re, subprocess, sys, threading, time, urllib.error, urllib.request

tansy, backend, model = os.environ["DSC_TANSY"], os.environ["DSC_BACKEND"], os.environ["DSC_MODEL"]
prompt, n, threads = os.environ["DSC_PROMPT"], int(os.environ["DSC_N"]), os.environ["DSC_THREADS"]
engine = ["--backend", backend, "--model", model] + (["--threads", threads] if threads else [])
failures = []


def check(ok, what):
    print(("ok:   " if ok else "FAIL: ") + what, flush=True)
    if not ok:
        failures.append(what)


def norm(s):
    return " ".join(s.split())


cmd = [tansy, "serve", "--host", "127.0.0.1", "--port", "0", "--quiet"] + engine
print("device-serve-check:", " ".join(cmd), flush=True)
t0 = time.time()
srv = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       errors="replace")
log, port, got_port = [], [None], threading.Event()


def reader():
    for line in srv.stderr:
        log.append(line)
        m = re.search(r"listening on http://[0-9.]+:(\d+)", line)
        if m:
            port[0] = int(m.group(1))
            got_port.set()
    got_port.set()


threading.Thread(target=reader, daemon=True).start()


def stop():
    if srv.poll() is None:
        srv.terminate()  # SIGTERM: graceful shutdown
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    return srv.returncode


def die(msg):
    stop()
    print("".join(log[-30:]), end="")
    print("device-serve-check: FAIL:", msg)
    sys.exit(1)


if not got_port.wait(120) or port[0] is None:
    die("the server did not start")
base = f"http://127.0.0.1:{port[0]}"
deadline = time.time() + 300
while True:  # 503 while the model loads
    try:
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            if r.status == 200:
                break
    except (urllib.error.URLError, ConnectionError):
        pass
    if srv.poll() is not None or time.time() > deadline:
        die("/health never answered 200")
    time.sleep(0.2)
print(f"server ready on port {port[0]} in {time.time() - t0:.1f} s", flush=True)

body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": n,
        "chat_template_kwargs": {"enable_thinking": False}}


def post(extra):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(dict(body, **extra)).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=300)


try:
    with post({}) as r:
        full = json.load(r)
    msg = full["choices"][0]["message"]
    text, reasoning = msg.get("content") or "", msg.get("reasoning_content") or ""
    usage = full.get("usage") or {}
    print(f"non-streamed: {text!r} (finish {full['choices'][0]['finish_reason']}, usage {usage})", flush=True)

    s_text, s_reasoning, s_finish, s_usage, done = "", "", None, None, False
    with post({"stream": True, "stream_options": {"include_usage": True}}) as r:
        for raw in r:
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            c = json.loads(line[6:])
            if c.get("usage"):
                s_usage = c["usage"]
            for ch in c.get("choices") or []:
                d = ch.get("delta") or {}
                s_text += d.get("content") or ""
                s_reasoning += d.get("reasoning_content") or ""
                s_finish = ch.get("finish_reason") or s_finish
    print(f"streamed:     {s_text!r} (finish {s_finish}, usage {s_usage})", flush=True)
except Exception as e:  # noqa: BLE001 - any failure of the requests is a failed check
    die(f"request failed: {e!r}")

code = stop()
check(code == 0, f"server exited cleanly on SIGTERM (code {code})")
check(done, "the stream ended with data: [DONE]")
check(text != "" and usage.get("completion_tokens", 0) > 0, "the server generated text")
check(s_text == text and s_reasoning == reasoning, "streamed text == non-streamed text")
check(s_usage is None or s_usage.get("completion_tokens") == usage.get("completion_tokens"),
      "streamed usage == non-streamed usage")

run = [tansy, "run", "--prompt", prompt, "-n", str(n), "--temperature", "0", "--no-think", "--verbose"] + engine
print("device-serve-check:", " ".join(run), flush=True)
r = subprocess.run(run, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
check(r.returncode == 0, f"tansy run exit code {r.returncode}" + (": " + r.stderr[-2000:] if r.returncode else ""))
m = re.search(r"generated (\d+) tokens", r.stderr)
run_n = int(m.group(1)) if m else None
print(f"tansy run:    {r.stdout!r} ({run_n} tokens)", flush=True)
check(norm(r.stdout) == norm(text), "server text == tansy run text (whitespace-normalised)")
print(f"      byte-exact (run's output less its final newline): {r.stdout[:-1] == text}", flush=True)
check(run_n == usage.get("completion_tokens"), f"token count: run {run_n}, server {usage.get('completion_tokens')}")

print(f"device-serve-check ({backend}): {'FAIL: ' + '; '.join(failures) if failures else 'PASS'}", flush=True)
sys.exit(1 if failures else 0)
EOF
