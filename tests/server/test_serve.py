#!/usr/bin/env python3
"""End-to-end tests of `tansy serve` with the official openai package and curl (ctest label: server).

Each group starts its own server on a free loopback port with the embedded tiny model on the CPU backend:
    api       endpoints, streaming, reasoning, tools round trip, stop, JSON mode, logprobs, errors, auth, curl
    responses /v1/responses: items, events, function-call round trip, previous_response_id, text.format, errors
    schema    json_schema and schema-constrained tool calls: 50 sampled runs each validated with jsonschema
    greedy    greedy output through the server equals `tansy run`'s
    load      32 concurrent streaming clients x 4 requests, 5 disconnecting mid-stream; memory back to idle
    lifecycle /health 503 while loading, graceful SIGTERM/SIGINT shutdown with requests in flight
Usage: test_serve.py --tansy build/bin/tansy --source-dir . --group api
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import traceback

import openai

ARGS = None
API_KEY = "sk-tansy-test"
MODEL = "tiny-chat-q4"  # the served name (the model directory); other names get 404 model_not_found
TOOL_PROMPT = "Use a tool to find out what heapq.heappush does."


# ---------------------------------------------------------------- helpers

class Server:
    """`tansy serve --port 0` in the background; the port is read from its log."""

    def __init__(self, *extra, env=None, wait_ready=True, api_key=API_KEY):
        cmd = [ARGS.tansy, "serve", "--port", "0", "--threads", "1"] + list(extra)
        if api_key:
            cmd += ["--api-key", api_key]
        e = dict(os.environ)
        e.update(env or {})
        self.api_key = api_key
        self.clients = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=e, text=True,
                                     errors="replace")
        self.log = []
        self.port = None
        got_port = threading.Event()

        def reader():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on http://[0-9.]+:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    got_port.set()
            got_port.set()

        self.reader = threading.Thread(target=reader, daemon=True)
        self.reader.start()
        if not got_port.wait(60) or self.port is None:
            self.stop()
            raise AssertionError("server did not start:\n" + "".join(self.log))
        if wait_ready:
            self.wait_health(200, 120)

    def url(self, path=""):
        return f"http://127.0.0.1:{self.port}{path}"

    def client(self, **kw):
        c = openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key or "unused", max_retries=0,
                          timeout=kw.pop("timeout", 120), **kw)
        self.clients.append(c)
        return c

    def request(self, method, path, body=None, headers=None, auth=True, timeout=120):
        """Raw HTTP: returns (status, headers dict lower-cased, body bytes)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = dict(headers or {})
        if auth and self.api_key:
            h.setdefault("Authorization", "Bearer " + self.api_key)
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data

    def wait_health(self, status, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                s, _, _ = self.request("GET", "/health", timeout=5)
                if s == status:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise AssertionError("server exited:\n" + "".join(self.log))
            time.sleep(0.05)
        raise AssertionError(f"/health never returned {status}")

    def rss(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def metrics(self):
        s, _, body = self.request("GET", "/metrics")
        assert s == 200, s
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def stop(self, sig=signal.SIGTERM, timeout=60):
        for c in self.clients:  # idle keep-alive connections would hold server workers until they time out
            c.close()
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.reader.join(5)
        return rc

    def check_clean_exit(self, rc):
        text = "".join(self.log)
        check(rc == 0, f"server exit status {rc}\n{text[-4000:]}")
        for bad in ("AddressSanitizer", "runtime error:", "LeakSanitizer", "tansy: internal error"):
            check(bad not in text, f"{bad} in the server log:\n{text[-6000:]}")


FAILURES = []


def check(cond, msg="check failed"):
    if not cond:
        raise AssertionError(msg)


def run_tests(tests):
    for t in tests:
        t0 = time.time()
        try:
            t()
            print(f"PASS {t.__name__} ({time.time() - t0:.1f} s)", flush=True)
        except Exception:
            FAILURES.append(t.__name__)
            print(f"FAIL {t.__name__} ({time.time() - t0:.1f} s)\n{traceback.format_exc()}", flush=True)


def demo_tools():
    with open(os.path.join(ARGS.source_dir, "models", "tiny-chat-q4", "demo_tools.json")) as f:
        return json.load(f)


def tool_messages(user=TOOL_PROMPT):
    d = demo_tools()
    return [{"role": "system", "content": d["system"]}, {"role": "user", "content": user}], d["tools"]


def collect_stream(stream):
    """Reassembles a chat stream: (reasoning, content, tool_calls, finish_reason, chunks)."""
    reasoning, content, calls, finish, chunks = "", "", {}, None, []
    order = []  # kinds of deltas in arrival order
    for ch in stream:
        chunks.append(ch)
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta
        r = getattr(d, "reasoning_content", None)
        if r:
            reasoning += r
            order.append("r")
        if d.content:
            content += d.content
            order.append("c")
        for tc in d.tool_calls or []:
            order.append("t")
            if tc.index not in calls:
                check(tc.id and tc.type == "function" and tc.function.name, f"first tool delta lacks id/name: {tc}")
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                check(not tc.function.name, "later tool deltas must not repeat the name")
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        if c.finish_reason:
            finish = c.finish_reason
    # reasoning is separated while streaming: it all comes before any answer delta
    if "r" in order and ("c" in order or "t" in order):
        first_answer = min(i for i, k in enumerate(order) if k != "r")
        check("r" not in order[first_answer:], f"reasoning delta after the answer began: {order}")
    return reasoning, content, [calls[i] for i in sorted(calls)], finish, chunks


# ---------------------------------------------------------------- group: api

def group_api():
    srv = Server("--max-batch", "8", "--max-body", "1", "--ctx-size", "4096")
    cl = srv.client()

    def health_models_metrics():
        s, h, body = srv.request("GET", "/health", auth=False)
        check(s == 200 and json.loads(body)["status"] == "ok", body)
        models = cl.models.list()
        check([m.id for m in models.data] == ["tiny-chat-q4"], str(models))
        m = cl.models.retrieve("tiny-chat-q4")
        check(m.id == "tiny-chat-q4")
        mt = srv.metrics()
        for k in ("tansy_model_loaded", "tansy_queue_depth", "tansy_active_sequences", "tansy_state_memory_bytes",
                  "tansy_time_to_first_token_seconds_count", "tansy_inter_token_latency_seconds_count",
                  "process_resident_memory_bytes"):
            check(k in mt, f"/metrics lacks {k}")

    def tools_round_trip():
        msgs, tools = tool_messages()
        r = cl.chat.completions.create(model="tiny-chat-q4", messages=msgs, tools=tools, temperature=0, max_tokens=300)
        check(r.object == "chat.completion" and r.id.startswith("chatcmpl-"), r)
        c = r.choices[0]
        check(c.finish_reason == "tool_calls", f"finish_reason {c.finish_reason}: {c.message}")
        tc = c.message.tool_calls
        check(len(tc) == 1 and tc[0].type == "function" and tc[0].function.name == "get_docstring", tc)
        check(json.loads(tc[0].function.arguments) == {"name": "heapq.heappush"}, tc[0].function.arguments)
        check(tc[0].id.startswith("call_"), tc[0].id)
        check(c.message.reasoning_content, "thinking is on: reasoning_content expected")
        check("<tool_call>" not in (c.message.content or ""), "the call must not leak into content")
        u = r.usage
        check(u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens > 0, u)
        check(u.completion_tokens_details.reasoning_tokens > 0, u)
        # the tool result goes back; the model answers
        msgs2 = msgs + [{"role": "assistant", "content": c.message.content,
                         "tool_calls": [{"id": tc[0].id, "type": "function",
                                         "function": {"name": "get_docstring", "arguments": tc[0].function.arguments}}]},
                        {"role": "tool", "tool_call_id": tc[0].id,
                         "content": "heappush(heap, item): Push item onto heap, maintaining the heap invariant."}]
        r2 = cl.chat.completions.create(model="tiny-chat-q4", messages=msgs2, tools=tools, temperature=0, max_tokens=300)
        c2 = r2.choices[0]
        check(c2.finish_reason in ("stop", "tool_calls", "length"), c2.finish_reason)
        check((c2.message.content or "") or c2.message.tool_calls, f"no answer after the tool result: {c2}")
        # streamed: the same call, incrementally, with index
        s = cl.chat.completions.create(model="tiny-chat-q4", messages=msgs, tools=tools, temperature=0,
                                       max_tokens=300, stream=True)
        reasoning, content, calls, finish, _ = collect_stream(s)
        check(finish == "tool_calls", finish)
        check(reasoning == c.message.reasoning_content, (reasoning, c.message.reasoning_content))
        check(content == (c.message.content or ""), (content, c.message.content))
        check(len(calls) == 1 and calls[0]["name"] == "get_docstring", calls)
        check(calls[0]["arguments"] == tc[0].function.arguments, (calls[0]["arguments"], tc[0].function.arguments))
        s2 = cl.chat.completions.create(model="tiny-chat-q4", messages=msgs2, tools=tools, temperature=0,
                                        max_tokens=300, stream=True)
        reasoning2, content2, _, finish2, _ = collect_stream(s2)
        check(content2 == (c2.message.content or "") and finish2 == c2.finish_reason, (content2, c2.message.content))

    def reasoning_on_off():
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        on = cl.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=200)
        check(on.choices[0].message.reasoning_content, "thinking on: reasoning expected")
        check("<think>" not in (on.choices[0].message.content or "") and "</think>" not in (on.choices[0].message.content or ""))
        off = cl.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=200,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        m = off.choices[0].message
        check(m.reasoning_content is None and m.content, m)
        check(off.usage.completion_tokens_details.reasoning_tokens == 0, off.usage)
        none = cl.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=200,
                                          extra_body={"reasoning_effort": "none"})
        check(none.choices[0].message.content == m.content, "reasoning_effort none == enable_thinking false")
        # streaming separates reasoning too
        st = cl.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=200, stream=True)
        reasoning, content, _, finish, _ = collect_stream(st)
        check(reasoning == on.choices[0].message.reasoning_content and content == on.choices[0].message.content,
              (reasoning, content))

    def usage_chunk():
        st = cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], temperature=0,
                                        max_tokens=30, stream=True, stream_options={"include_usage": True})
        chunks = list(st)
        last = chunks[-1]
        check(last.choices == [] and last.usage is not None, last)
        check(last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens, last.usage)
        check(all(c.usage is None for c in chunks[:-1]), "only the last chunk carries usage")
        check(chunks[-2].choices[0].finish_reason in ("stop", "length"), chunks[-2])
        # without include_usage no usage chunk
        st = cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], temperature=0,
                                        max_tokens=10, stream=True)
        check(all(c.choices for c in st), "no usage chunk unless asked")

    def stop_sequences():
        msgs = [{"role": "user", "content": "Write a short story about a cat."}]
        kw = dict(model=MODEL, messages=msgs, temperature=0, max_tokens=120,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        full = cl.chat.completions.create(**kw).choices[0].message.content
        check(len(full) > 40, full)
        for start in (12, len(full) // 2):
            stop = full[start:start + 5]
            cut = full[:full.find(stop)]
            r = cl.chat.completions.create(stop=[stop, "zzzz-never"], **kw)
            check(r.choices[0].message.content == cut, (stop, r.choices[0].message.content, cut))
            check(r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)
            s = cl.chat.completions.create(stop=stop, stream=True, **kw)
            _, content, _, finish, _ = collect_stream(s)
            check(content == cut and stop not in content and finish == "stop", (stop, content, cut))
        # completions: a stop string never leaks either
        text = cl.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0).choices[0].text
        stop = text[8:12]
        r = cl.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0, stop=stop)
        check(r.choices[0].text == text[:text.find(stop)] and r.choices[0].finish_reason == "stop", (r, stop))

    def completions():
        r = cl.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
        check(r.object == "text_completion" and r.id.startswith("cmpl-"), r)
        check(r.choices[0].finish_reason in ("stop", "length") and r.choices[0].text, r)
        check(r.usage.completion_tokens <= 20 and r.usage.prompt_tokens > 0, r.usage)
        s = cl.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        for ch in s:
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            if ch.usage:
                usage = ch.usage
        check(text == r.choices[0].text and finish == r.choices[0].finish_reason, (text, r.choices[0].text))
        check(usage and usage.completion_tokens == r.usage.completion_tokens, usage)
        ids = cl.completions.create(model=MODEL, prompt=[[1, 2, 3, 4]], max_tokens=5, temperature=0)
        check(ids.usage.prompt_tokens == 4, ids.usage)

    def json_mode():
        for thinking in (False, True):
            r = cl.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Describe a cat as a JSON object."}], temperature=0,
                max_tokens=120, response_format={"type": "json_object"},
                extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
            content = r.choices[0].message.content
            obj = json.loads(content)
            check(isinstance(obj, dict), content)
            s = cl.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object with a name."}],
                temperature=0.7, seed=5, max_tokens=60, response_format={"type": "json_object"}, stream=True,
                extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
            _, content, _, _, _ = collect_stream(s)
            check(isinstance(json.loads(content), dict), content)

    def settled_metrics():  # once the last request's sequence has left the scheduler (its counters are final)
        deadline = time.time() + 10
        while True:
            m = srv.metrics()
            if m["tansy_active_sequences"] == 0 or time.time() > deadline:
                return m
            time.sleep(0.05)

    def logprobs():
        m0 = settled_metrics()
        # log-probs cover the answer: with thinking, its reasoning tokens have none
        r = cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], temperature=0,
                                       max_tokens=200, logprobs=True, top_logprobs=3)
        lp = r.choices[0].logprobs.content
        check(1 <= len(lp) < r.usage.completion_tokens, (len(lp), r.usage))
        check("".join(e.token for e in lp).lstrip("\n") == r.choices[0].message.content,
              ("".join(e.token for e in lp), r.choices[0].message.content))
        for e in lp:
            check(isinstance(e.token, str) and e.logprob <= 0 and isinstance(e.bytes, list), e)
            check(len(e.top_logprobs) == 3, e)
            check(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob, e)
            check(abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4, "greedy picks the top token")
        s = cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], temperature=0,
                                       max_tokens=200, logprobs=True, top_logprobs=2, stream=True)
        n = sum(len(ch.choices[0].logprobs.content) for ch in s if ch.choices and ch.choices[0].logprobs)
        check(n == len(lp), (n, len(lp)))
        c = cl.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2)
        l = c.choices[0].logprobs
        check(len(l.tokens) == len(l.token_logprobs) == len(l.top_logprobs) == len(l.text_offset) > 0, l)
        check("".join(l.tokens) == c.choices[0].text, (l.tokens, c.choices[0].text))
        # greedy rows with log-probs are picked on the device, which reports a record per row: no logits row comes down
        picks = settled_metrics()["tansy_host_picks_total"] - m0["tansy_host_picks_total"]
        check(picks == 0, f"{picks} tokens were chosen on the host")

    def tool_choice():
        msgs, tools = tool_messages("Hello!")
        for choice in ("required", {"type": "function", "function": {"name": "run_python"}}):
            r = cl.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice=choice, temperature=0,
                                           max_tokens=200)
            c = r.choices[0]
            check(c.message.tool_calls, f"tool_choice {choice}: no call: {c.message}")
            if isinstance(choice, dict):
                check(c.message.tool_calls[0].function.name == "run_python", c.message.tool_calls)
            json.loads(c.message.tool_calls[0].function.arguments)
        msgs, tools = tool_messages()
        r = cl.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="none", temperature=0,
                                       max_tokens=200)
        check(not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls", r.choices[0])

    def sampling_fields():
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a haiku."}], max_tokens=30,
                  temperature=0.9, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.5,
                  extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}, user="someone")
        a = cl.chat.completions.create(**kw).choices[0].message
        b = cl.chat.completions.create(**kw).choices[0].message
        check((a.content, a.reasoning_content) == (b.content, b.reasoning_content), "same seed, same output")

    def errors():
        def expect(status, code=None, param=None, **req):
            body = req.pop("raw", None)
            path = req.pop("path", "/v1/chat/completions")
            method = req.pop("method", "POST")
            headers = req.pop("headers", None)
            auth = req.pop("auth", True)
            if body is None:
                body = req.pop("json")
            s, h, data = srv.request(method, path, body=body, headers=headers, auth=auth)
            check(s == status, f"{status} expected, got {s}: {data[:300]}")
            e = json.loads(data)["error"]
            check(set(e) >= {"message", "type", "param", "code"} and e["message"], e)
            if code is not None:
                check(e["code"] == code, e)
            if param is not None:
                check(e["param"] == param, e)
            return h, e

        hi = [{"role": "user", "content": "hi"}]
        expect(400, "invalid_json", raw=b'{"messages": [')
        expect(400, raw=b"[1, 2]")
        expect(400, param="messages", json={"model": MODEL})
        expect(400, param="messages", json={"messages": []})
        expect(400, param="messages[0].role", json={"messages": [{"role": "wizard", "content": "hi"}]})
        expect(400, param="messages[0].content", json={"messages": [{"role": "user", "content": 42}]})
        expect(400, param="temperature", json={"messages": hi, "temperature": "warm"})
        expect(400, param="max_tokens", json={"messages": hi, "max_tokens": -5})
        expect(400, param="n", json={"messages": hi, "n": 2})
        expect(400, param="stream", json={"messages": hi, "stream": "yes"})
        expect(400, "invalid_utf8", raw=b'{"messages": [{"role": "user", "content": "caf\xe9"}]}')
        expect(400, "invalid_tool_call_arguments", json={"messages": hi + [
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": "{oops"}}]}]})
        expect(400, "context_length_exceeded", param="messages", json={"messages": hi, "max_tokens": 5000})
        expect(400, "context_length_exceeded", json={"messages": [{"role": "user", "content": "word " * 5000}]})
        expect(400, param="prompt", path="/v1/completions", json={"prompt": 5})
        expect(413, raw=b'{"messages": "' + b"x" * (2 << 20) + b'"}')
        # a chunked body has no Content-Length to check up front: it is counted as it arrives
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        c.request("POST", "/v1/chat/completions", body=iter([b'{"messages": "', b"x" * (2 << 20), b'"}']),
                  headers={"Authorization": "Bearer " + API_KEY}, encode_chunked=True)
        r = c.getresponse()
        check(r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large", r.status)
        c.close()
        h, _ = expect(401, "invalid_api_key", json={"messages": hi}, auth=False)
        check("www-authenticate" in h, h)
        expect(401, json={"messages": hi}, headers={"Authorization": "Bearer wrong"})
        expect(401, path="/v1/models", method="GET", raw=b"", auth=False)
        expect(404, path="/v1/nothing", method="GET", raw=b"")
        expect(405, path="/v1/chat/completions", method="GET", raw=b"")
        # the official client maps them to its exceptions
        try:
            openai.OpenAI(base_url=srv.url("/v1"), api_key="bad", max_retries=0).models.list()
            check(False, "bad key accepted")
        except openai.AuthenticationError:
            pass
        try:
            cl.chat.completions.create(model=MODEL, messages=hi, max_tokens=10 ** 6)
            check(False, "over-long request accepted")
        except openai.BadRequestError as e:
            check(e.code == "context_length_exceeded", e)
        # mangled bodies: a 400 (or a normal answer), never a 500, never a crash
        rng = random.Random(7)
        seed = json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
            {"type": "text", "text": "hi"}]}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "content": "r"}], "tools": [{"type": "function", "function": {"name": "f"}}],
            "max_tokens": 1, "stop": ["x"], "logprobs": True}).encode()
        statuses = {}
        for _ in range(150):
            b = bytearray(seed)
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(len(b))
                op = rng.randrange(3)
                if op == 0:
                    b[at] = rng.randrange(256)
                elif op == 1:
                    del b[at:at + rng.randint(1, 6)]
                else:
                    b[at:at] = rng.choice([b"null", b"[]", b"{}", b"\\ud800", b"1e999", b'"', b"\xff"])
            s, _, data = srv.request("POST", "/v1/chat/completions", bytes(b))
            statuses[s] = statuses.get(s, 0) + 1
            check(s in (200, 400), f"{s} for {bytes(b)!r}: {data[:200]}")
            if s == 400:
                check(json.loads(data)["error"]["message"], data)
        check(statuses.get(400, 0) > 100, statuses)
        # the server is still fine
        check(cl.chat.completions.create(model=MODEL, messages=hi, max_tokens=5).choices[0].finish_reason)

    def curl():
        base = ["curl", "-sS", "-H", "Authorization: Bearer " + API_KEY, "-H", "Content-Type: application/json"]
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 20,
                           "temperature": 0, "stream": True})
        out = subprocess.run(base + ["-N", "-d", body, srv.url("/v1/chat/completions")], capture_output=True,
                             text=True, timeout=60).stdout
        events = [l for l in out.split("\n") if l]
        check(all(l.startswith("data: ") for l in events), out[:500])
        check(events[-1] == "data: [DONE]", events[-3:])
        chunks = [json.loads(l[6:]) for l in events[:-1]]
        check(all(c["object"] == "chat.completion.chunk" for c in chunks), chunks[0])
        check(chunks[0]["choices"][0]["delta"].get("role") == "assistant", chunks[0])
        check(chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks[-1])
        one = subprocess.run(base + ["-d", json.dumps({"prompt": "Hi", "max_tokens": 3}), srv.url("/v1/completions")],
                             capture_output=True, text=True, timeout=60).stdout
        check(json.loads(one)["object"] == "text_completion", one)
        code = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", srv.url("/v1/models")],
                              capture_output=True, text=True, timeout=30).stdout
        check(code == "401", code)
        health = subprocess.run(["curl", "-s", srv.url("/health")], capture_output=True, text=True, timeout=30).stdout
        check(json.loads(health) == {"status": "ok"}, health)
        # curl -d without a content type sends application/x-www-form-urlencoded (and Expect: 100-continue
        # above 1 KB): a large body must still be read as JSON
        # (the bulk is an unknown field, which is ignored: a long prompt would be slow under ASan)
        big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                          "unknown_field": {"padding": "x" * 9000}})
        out = subprocess.run(["curl", "-sS", "-H", "Authorization: Bearer " + API_KEY, "-d", big,
                              srv.url("/v1/chat/completions")], capture_output=True, text=True, timeout=60).stdout
        check(json.loads(out)["object"] == "chat.completion", out[:300])

    def issue36_clients():
        # 1. a system/developer message after the first is a system turn in place, never a 400
        for role in ("system", "developer"):
            r = cl.chat.completions.create(model=MODEL, max_tokens=5, messages=[
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": role, "content": "Answer in JSON."}, {"role": "user", "content": "again"}])
            check(r.choices[0].finish_reason in ("stop", "length"), r)
        # 2. a list of prompts: one choice each, in order, each equal to its single-prompt completion
        prompts = ["Once upon a time", "The cat", "In the beginning"]
        singles = [cl.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
                   for p in prompts]
        r = cl.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
        check([c.index for c in r.choices] == [0, 1, 2], r.choices)
        check([c.text for c in r.choices] == singles, (r.choices, singles))
        check(r.usage.completion_tokens <= 24 and r.usage.prompt_tokens >= 6, r.usage)
        texts = {}
        finishes = {}
        for ch in cl.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, stream=True):
            for c in ch.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason
        check([texts.get(i) for i in range(3)] == singles and len(finishes) == 3, (texts, singles, finishes))
        ids = cl.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=3, temperature=0)
        check(len(ids.choices) == 2 and ids.usage.prompt_tokens == 5, ids)
        # 3. a stop string found only in the reasoning does not end the request
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Why is the sky blue?"}], temperature=0,
                  max_tokens=60)
        full = cl.chat.completions.create(**kw).choices[0].message
        reasoning = full.reasoning_content or ""
        words = [w for w in re.findall(r"[A-Za-z]{4,}", reasoning) if w not in (full.content or "")]
        if words:
            r = cl.chat.completions.create(stop=[words[0]], **kw).choices[0].message
            check(r.reasoning_content == full.reasoning_content and r.content == full.content, (words[0], r, full))
        # 4. tool_choice none: <tool_call> can not be generated, even when pushed hard
        msgs, tools = tool_messages()
        for fields in ({"tools": tools, "tool_choice": "none"}, {"functions": [t["function"] for t in tools],
                                                                  "function_call": "none"}):
            s, _, body = srv.request("POST", "/v1/chat/completions", json.dumps(dict(
                model=MODEL, messages=msgs, max_tokens=20, temperature=0, logit_bias={"4067": 100},
                chat_template_kwargs={"enable_thinking": False}, **fields)).encode())
            check(s == 200, body)
            m = json.loads(body)["choices"][0]["message"]
            check("<tool_call>" not in (m["content"] or "") and not m.get("tool_calls"), m)
        # the same push without tool_choice none does produce the token (the test above can fail)
        s, _, body = srv.request("POST", "/v1/chat/completions", json.dumps(dict(
            model=MODEL, messages=msgs, max_tokens=5, temperature=0, logit_bias={"4067": 100},
            chat_template_kwargs={"enable_thinking": False})).encode())
        m = json.loads(body)["choices"][0]["message"]
        check(m.get("tool_calls") or "<tool_call>" in (m["content"] or ""), m)
        # 5. field policy: no-ops accepted, unsupported refused naming the field, unknown warned once
        r = cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       user="u", metadata={"k": "v"}, store=False, parallel_tool_calls=False,
                                       reasoning_effort="minimal", extra_body={"tansy_unknown_probe": 1})
        check(not r.choices[0].message.reasoning_content, r)
        cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                   extra_body={"tansy_unknown_probe": 2})
        s, _, body = srv.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "alloy"}}).encode())
        check(s == 400 and json.loads(body)["error"]["param"] == "audio", body)
        time.sleep(0.2)
        check(sum("tansy_unknown_probe" in l for l in srv.log) == 1, [l for l in srv.log if "probe" in l])

    def prefix_cache():
        # issue 30: a second request with the same long prefix restores it (usage.prompt_tokens_details)
        system = " ".join(f"Rule {i}: answer in plain words and keep each answer short." for i in range(40))
        def ask(user, stream=False, cache=True):
            body = {"model": MODEL, "temperature": 0, "max_tokens": 8,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
            if not cache:
                body["cache_prompt"] = False
            if stream:
                body["stream"], body["stream_options"] = True, {"include_usage": True}
            s, _, raw = srv.request("POST", "/v1/chat/completions", json.dumps(body).encode())
            check(s == 200, raw)
            if not stream:
                return json.loads(raw)
            events = [json.loads(l[6:]) for l in raw.decode().split("\n") if l.startswith("data: {")]
            return events
        first = ask("What is a heap?")
        check(first["usage"]["prompt_tokens"] > 300, first["usage"])
        check("prompt_tokens_details" in first["usage"], first["usage"])
        time.sleep(0.3)  # the finished sequence is stored once the scheduler sweeps it
        second = ask("What is a stack?")
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        check(0 < cached < second["usage"]["prompt_tokens"], second["usage"])
        again = ask("What is a heap?")
        check(again["choices"][0]["message"] == first["choices"][0]["message"], (again, first))
        check(again["usage"]["prompt_tokens_details"]["cached_tokens"] > cached / 2, again["usage"])
        off = ask("What is a heap?", cache=False)
        check(off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, off["usage"])
        check(off["choices"][0]["message"] == first["choices"][0]["message"], (off, first))
        events = ask("What is a queue?", stream=True)
        check(events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0,
              events[-1])
        mt = srv.metrics()
        for k in ("tansy_prefix_cache_hits_total", "tansy_prefix_cache_cached_tokens_total",
                  "tansy_prefix_cache_evictions_total", "tansy_prefix_cache_bytes", "tansy_prefix_cache_entries"):
            check(k in mt, f"/metrics lacks {k}")

    run_tests([health_models_metrics, tools_round_trip, reasoning_on_off, usage_chunk, stop_sequences, completions,
               json_mode, logprobs, tool_choice, sampling_fields, errors, curl, issue36_clients, prefix_cache])
    srv.check_clean_exit(srv.stop())


# ---------------------------------------------------------------- group: responses

RESPONSE_EVENTS = {
    "response.created", "response.in_progress", "response.output_item.added", "response.output_item.done",
    "response.content_part.added", "response.content_part.done", "response.output_text.delta",
    "response.output_text.done", "response.reasoning_text.delta", "response.reasoning_text.done",
    "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.completed",
    "response.incomplete"}


def collect_response_stream(stream):
    """Reassembles a Responses stream: (final response, {item id: text/arguments from the deltas}, events)."""
    events, texts, final = [], {}, None
    for e in stream:
        check(e.type in RESPONSE_EVENTS, f"unexpected event {e.type}: {e}")
        check(type(e).__name__.endswith("Event"), f"the SDK did not parse {e.type}: {type(e)}")
        check(e.sequence_number == len(events), (e.sequence_number, len(events)))
        events.append(e)
        if e.type in ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.function_call_arguments.delta"):
            texts[e.item_id] = texts.get(e.item_id, "") + e.delta
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    check(final is not None and events[0].type == "response.created" and events[-1] is not None, "no final event")
    check(events[-1].type in ("response.completed", "response.incomplete"), events[-1].type)
    for e in events:  # every item's done text equals its deltas
        if e.type == "response.output_item.done":
            it = e.item
            if it.type == "message":
                check(it.content[0].text == texts.get(it.id, ""), (it.content[0].text, texts.get(it.id)))
            elif it.type == "reasoning":
                check(it.content[0].text == texts.get(it.id, ""), it)
            elif it.type == "function_call":
                check(it.arguments == texts.get(it.id, ""), (it.arguments, texts.get(it.id)))
    return final, texts, events


def flat_tools():
    """demo_tools.json's chat-shaped tools in the Responses shape (flat)."""
    return [{"type": "function", **t["function"]} for t in demo_tools()["tools"]]


def group_responses():
    srv = Server("--max-batch", "4", "--ctx-size", "4096")
    cl = srv.client()
    off = {"effort": "none"}  # thinking off: short, deterministic answers

    def basic_and_stream():
        r = cl.responses.create(model=MODEL, input="What is the capital of France?", reasoning=off, temperature=0,
                                max_output_tokens=24)
        check(r.object == "response" and r.id.startswith("resp_") and r.model == MODEL, r)
        check(r.status in ("completed", "incomplete"), r.status)
        check((r.status == "incomplete") == (r.incomplete_details is not None), r)
        check(r.error is None and r.previous_response_id is None and r.store is True, r)
        check([o.type for o in r.output] == ["message"], r.output)
        m = r.output[0]
        check(m.id.startswith("msg_") and m.role == "assistant" and m.content[0].type == "output_text", m)
        check(r.output_text and r.output_text == m.content[0].text, r.output_text)
        u = r.usage
        check(u.input_tokens > 0 and 0 < u.output_tokens <= 24 and u.total_tokens == u.input_tokens + u.output_tokens, u)
        check(u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens == 0, u)
        check(r.max_output_tokens == 24 and r.temperature == 0 and r.tool_choice == "auto" and r.tools == [], r)
        # streamed: the same text, as events the SDK knows, numbered in order
        final, _, events = collect_response_stream(cl.responses.create(
            model=MODEL, input="What is the capital of France?", reasoning=off, temperature=0, max_output_tokens=24,
            stream=True))
        check(final.output_text == r.output_text and final.status == r.status, (final.output_text, r.output_text))
        check(final.usage.output_tokens == u.output_tokens, final.usage)
        check(events[1].type == "response.in_progress" and events[0].response.status == "in_progress", events[:2])
        # thinking on: a reasoning item first, then the answer
        t = cl.responses.create(model=MODEL, input="Hello!", instructions="Answer briefly.", temperature=0,
                                max_output_tokens=200)
        check(t.output[0].type == "reasoning" and t.output[0].id.startswith("rs_"), t.output)
        check(t.output[0].summary == [] and t.output[0].content[0].type == "reasoning_text" and t.output[0].content[0].text, t)
        check(t.usage.output_tokens_details.reasoning_tokens > 0 and t.instructions == "Answer briefly.", t)
        ts, _, _ = collect_response_stream(cl.responses.create(model=MODEL, input="Hello!", instructions="Answer briefly.",
                                                               temperature=0, max_output_tokens=200, stream=True))
        check([o.type for o in ts.output] == [o.type for o in t.output], (ts.output, t.output))
        check(ts.output[0].content[0].text == t.output[0].content[0].text and ts.output_text == t.output_text, ts)

    def tool_round_trip():
        system = demo_tools()["system"]
        kw = dict(model=MODEL, instructions=system, tools=flat_tools(), reasoning=off, temperature=0)
        r = cl.responses.create(input=TOOL_PROMPT, tool_choice={"type": "function", "name": "get_docstring"},
                                max_output_tokens=60, **kw)
        calls = [o for o in r.output if o.type == "function_call"]
        check(len(calls) == 1 and calls[0].name == "get_docstring", r.output)
        fc = calls[0]
        check(fc.call_id.startswith("call_") and fc.id.startswith("fc_") and fc.status == "completed", fc)
        check(isinstance(json.loads(fc.arguments), dict), fc.arguments)
        check(r.tools[0].name == "get_docstring" and r.tool_choice.name == "get_docstring", r)
        out = {"type": "function_call_output", "call_id": fc.call_id,
               "output": "heappush(heap, item): Push item onto heap, maintaining the heap invariant."}
        # continued through previous_response_id (instructions are not carried over: given again)
        r2 = cl.responses.create(previous_response_id=r.id, input=[out], max_output_tokens=40, **kw)
        check(r2.previous_response_id == r.id and r2.status in ("completed", "incomplete"), r2)
        check(r2.output and r2.usage.input_tokens > r.usage.input_tokens, (r2.output, r2.usage, r.usage))
        # the same conversation sent whole gives the same answer
        r3 = cl.responses.create(input=[{"role": "user", "content": TOOL_PROMPT}, fc.model_dump(exclude_none=True), out],
                                 max_output_tokens=40, **kw)
        check([o.type for o in r3.output] == [o.type for o in r2.output] and r3.output_text == r2.output_text,
              (r3.output, r2.output))
        check(r3.usage.input_tokens == r2.usage.input_tokens, (r3.usage, r2.usage))
        # streamed call: arguments as deltas, the same call
        s, texts, events = collect_response_stream(cl.responses.create(
            input=TOOL_PROMPT, tool_choice="required", max_output_tokens=60, stream=True, **kw))
        scalls = [o for o in s.output if o.type == "function_call"]
        check(scalls and isinstance(json.loads(scalls[0].arguments), dict), s.output)
        check(any(e.type == "response.function_call_arguments.done" for e in events), "no arguments.done")

    def previous_response_and_store():
        a = cl.responses.create(model=MODEL, input="My name is Ada.", reasoning=off, temperature=0, max_output_tokens=8)
        b = cl.responses.create(model=MODEL, previous_response_id=a.id, input="What is my name?", reasoning=off,
                                temperature=0, max_output_tokens=8)
        check(b.previous_response_id == a.id and b.usage.input_tokens > a.usage.input_tokens + a.usage.output_tokens,
              (a.usage, b.usage))
        got = cl.responses.retrieve(a.id)
        check(got.id == a.id and got.output_text == a.output_text and got.usage == a.usage, got)
        # streamed responses are stored too
        s, _, _ = collect_response_stream(cl.responses.create(model=MODEL, previous_response_id=b.id, input="Thanks",
                                                              reasoning=off, temperature=0, max_output_tokens=8,
                                                              stream=True))
        check(cl.responses.retrieve(s.id).output_text == s.output_text, s)
        n = cl.responses.create(model=MODEL, input="Hi", reasoning=off, max_output_tokens=4, store=False)
        check(n.store is False, n)
        for rid in (n.id, "resp_unknown"):
            try:
                cl.responses.retrieve(rid)
                check(False, "retrieving an unstored response must fail")
            except openai.NotFoundError as e:
                check(rid in e.body["message"], e.body)
        try:
            cl.responses.create(model=MODEL, previous_response_id=n.id, input="Hi", max_output_tokens=4)
            check(False, "an unstored previous_response_id must fail")
        except openai.NotFoundError as e:
            check(e.body["param"] == "previous_response_id" and n.id in e.body["message"], e.body)
        cl.responses.delete(a.id)
        try:
            cl.responses.retrieve(a.id)
            check(False, "deleted")
        except openai.NotFoundError:
            pass

    def text_format():
        r = cl.responses.create(model=MODEL, input="Describe a cat as a JSON object.", reasoning=off, temperature=0,
                                max_output_tokens=120, text={"format": {"type": "json_object"}})
        check(isinstance(json.loads(r.output_text), dict), r.output_text)
        check(r.text.format.type == "json_object", r.text)
        schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                  "additionalProperties": False}
        s, _, _ = collect_response_stream(cl.responses.create(
            model=MODEL, input="Give me a JSON object with a name.", reasoning=off, temperature=0,
            max_output_tokens=120, stream=True,
            text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}))
        check(isinstance(json.loads(s.output_text), dict), s.output_text)
        check(s.text.format.type == "json_schema" and s.text.format.name == "person", s.text)

    def errors():
        def expect(status, param=None, code=None, body=None, method="POST", path="/v1/responses", auth=True):
            st, _, data = srv.request(method, path, body=body, auth=auth)
            check(st == status, f"{status} expected, got {st}: {data[:300]}")
            e = json.loads(data)["error"]
            check(set(e) >= {"message", "type", "param", "code"} and e["message"], e)
            if param is not None:
                check(e["param"] == param, e)
            if code is not None:
                check(e["code"] == code, e)

        expect(400, "input[0].type", "unsupported_value", {"input": [{"type": "computer_call_output", "call_id": "x"}]})
        expect(400, "input[0].content[1]", "unsupported_content",
               {"input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                                       {"type": "input_image", "image_url": "https://x/y.png"}]}]})
        expect(400, "tools[0].type", "unsupported_value", {"input": "hi", "tools": [{"type": "web_search"}]})
        expect(400, "input", None, {})
        expect(400, "max_output_tokens", None, {"input": "hi", "max_output_tokens": 0})
        expect(404, "model", "model_not_found", {"input": "hi", "model": "gpt-9"})
        expect(401, None, None, {"input": "hi"}, auth=False)
        expect(404, None, None, None, "GET", "/v1/responses/resp_nope")
        expect(404, None, None, None, "DELETE", "/v1/responses/resp_nope")
        expect(404, None, "unknown_url", None, "GET", "/v1/responses/resp_nope/input_items")
        try:
            cl.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "msg_1"}])
            check(False, "item_reference must be refused")
        except openai.BadRequestError as e:
            check(e.body["param"] == "input[0].type", e.body)

    def stream_disconnect_cancels():
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        c.request("POST", "/v1/responses", body=json.dumps({"input": "Write a long story.", "stream": True,
                                                            "max_output_tokens": 3000}),
                  headers={"Authorization": "Bearer " + API_KEY, "Content-Type": "application/json"})
        resp = c.getresponse()
        check(resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream"), resp.status)
        head = resp.read(2000).decode(errors="replace")
        check(head.startswith("event: response.created\ndata: "), head[:200])
        c.close()
        deadline = time.time() + 30
        while time.time() < deadline:
            m = srv.metrics()
            if m["tansy_active_sequences"] == 0 and m["tansy_queue_depth"] == 0:
                break
            time.sleep(0.05)
        check(m["tansy_active_sequences"] == 0, "the sequence of a disconnected Responses stream must be cancelled")

    run_tests([basic_and_stream, tool_round_trip, previous_response_and_store, text_format, errors,
               stream_disconnect_cancels])
    srv.check_clean_exit(srv.stop())


# ---------------------------------------------------------------- group: greedy

def normalize(s):
    return " ".join(s.split())


def tansy_run(*args, stderr=False):
    r = subprocess.run([ARGS.tansy, "run", "--threads", "1"] + list(args), capture_output=True, text=True, timeout=300)
    check(r.returncode == 0, r.stderr)
    return (r.stdout, r.stderr) if stderr else r.stdout


def group_greedy():
    srv = Server()
    cl = srv.client()

    def raw_completion_equals_tansy_run_raw():
        for prompt in ("Once upon a time", "def fibonacci(n):"):
            out = tansy_run("--raw", "--prompt", prompt, "-n", "60")
            r = cl.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0)
            check(r.choices[0].text == out[:-1], (r.choices[0].text, out))  # run ends with a newline

    def chat_equals_tansy_run():
        d = demo_tools()
        tools_file = os.path.join(ARGS.source_dir, "models", "tiny-chat-q4", "demo_tools.json")
        cases = [(["--prompt", TOOL_PROMPT, "--tools", tools_file], tool_messages()[0], d["tools"], True),
                 (["--prompt", "What is 2+2?"], [{"role": "user", "content": "What is 2+2?"}], None, True),
                 (["--prompt", "Write a haiku about rain.", "--no-think"],
                  [{"role": "user", "content": "Write a haiku about rain."}], None, False)]
        for run_args, msgs, tools, thinking in cases:
            # on a pipe, `tansy run` writes the answer to stdout and the reasoning to stderr
            out, err = tansy_run(*run_args, "-n", "200", stderr=True)
            kw = dict(model=MODEL, messages=msgs, temperature=0, max_tokens=200,
                      extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
            if tools:
                kw["tools"] = tools
            m = cl.chat.completions.create(**kw).choices[0].message
            text = m.content or ""
            for tc in m.tool_calls or []:  # the call as the model wrote it
                args = json.loads(tc.function.arguments)
                text += f"\n<tool_call>\n<function={tc.function.name}>\n" + "".join(
                    f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items()) + "</function>\n</tool_call>"
            check(normalize(text) == normalize(out), f"server: {text!r}\nrun:    {out!r}")
            check(normalize(m.reasoning_content or "") == normalize(err), f"server: {m.reasoning_content!r}\nrun:    {err!r}")

    run_tests([raw_completion_equals_tansy_run_raw, chat_equals_tansy_run])
    srv.check_clean_exit(srv.stop())


# ---------------------------------------------------------------- group: load

# Mixed endpoints, prompt and completion lengths, kept short: the load test also runs under ASan, where a token
# costs ~10-40x what it costs in a release build.
LOAD_PROMPTS = [("chat", "Hello!", 4), ("chat", "What is 2+2?", 8), ("chat", "Write a haiku about the sea.", 12),
                ("chat", "List three colours.", 6), ("text", "Once upon a time", 14), ("text", "def add(a, b):", 8),
                ("text", "The capital of France is", 4), ("text", "1, 2, 3,", 10)]


def stream_once(cl, k, disconnect_after=None):
    """One streamed request for prompt k; returns the reassembled output, or None when it disconnected."""
    kind, prompt, n = LOAD_PROMPTS[k]
    if kind == "chat":
        s = cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
                                       max_tokens=n, stream=True)
    else:
        s = cl.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=n, stream=True)
    if disconnect_after is not None:
        for i, _ in enumerate(s):
            if i + 1 >= disconnect_after:
                break
        s.close()  # drops the connection mid-stream
        return None
    if kind == "chat":
        reasoning, content, calls, finish, _ = collect_stream(s)
        return json.dumps([reasoning, content, calls, finish])
    text, finish = "", None
    for ch in s:
        if ch.choices:
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
    return json.dumps([text, finish])


def group_load():
    clients, per_client, disconnecting = 32, 4, 5
    # ASan's quarantine would hold freed memory back (256 MB by default): keep it small to see the idle level
    asan = os.environ.get("ASAN_OPTIONS", "")
    srv = Server("--max-batch", "16", "--max-queue", "64",
                 env={"ASAN_OPTIONS": (asan + ":" if asan else "") + "quarantine_size_mb=8"})
    cl = srv.client(timeout=300)

    def expected_outputs():
        return [stream_once(cl, k) for k in range(len(LOAD_PROMPTS))]

    def load():
        expected = expected_outputs()  # sequentially
        # warm-up burst: worker threads, their allocator arenas and the batch-sized buffers exist from here on,
        # so what the load adds on top of this idle level is what it failed to give back
        with concurrent.futures.ThreadPoolExecutor(clients) as ex:
            list(ex.map(lambda c: srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4), range(clients)))
        time.sleep(0.5)
        idle = srv.rss()
        m0 = srv.metrics()
        errors = []
        counts = {"ok": 0, "dropped": 0}
        lock = threading.Lock()

        def client(c):
            cc = srv.client(timeout=300)
            for i in range(per_client):
                k = (c * per_client + i) % len(LOAD_PROMPTS)
                drop = c < disconnecting and i == 1
                try:
                    got = stream_once(cc, k, disconnect_after=3 if drop else None)
                except Exception as e:  # noqa: BLE001
                    with lock:
                        errors.append(f"client {c} request {i}: {e!r}")
                    continue
                with lock:
                    if drop:
                        counts["dropped"] += 1
                    elif got != expected[k]:
                        errors.append(f"client {c} request {i} (prompt {k}): {got} != {expected[k]}")
                    else:
                        counts["ok"] += 1

        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(clients) as ex:
            list(ex.map(client, range(clients)))
        elapsed = time.time() - t0
        check(not errors, "\n".join(errors[:10]))
        check(counts["ok"] == clients * per_client - disconnecting and counts["dropped"] == disconnecting, counts)
        # every sequence is gone, its state freed
        deadline = time.time() + 10
        while time.time() < deadline:
            m = srv.metrics()
            if m["tansy_active_sequences"] == 0 and m["tansy_queue_depth"] == 0 and m["tansy_state_memory_bytes"] == 0:
                break
            time.sleep(0.1)
        check(m["tansy_active_sequences"] == 0 and m["tansy_state_memory_bytes"] == 0, m)
        check(m["tansy_client_disconnects_total"] >= disconnecting, m["tansy_client_disconnects_total"])
        time.sleep(0.5)
        after = srv.rss()
        rows = m["tansy_decode_rows_total"] - m0["tansy_decode_rows_total"]
        steps = m["tansy_decode_steps_total"] - m0["tansy_decode_steps_total"]
        print(f"load: {clients} clients x {per_client} requests ({disconnecting} disconnecting) in {elapsed:.1f} s; "
              f"mean decode batch {rows / max(steps, 1):.1f}; RSS idle {idle / 2**20:.1f} MiB, after "
              f"{after / 2**20:.1f} MiB", flush=True)
        # memory back to idle: allocator caches and (under ASan) the quarantine may keep some
        slack = (96 if os.environ.get("TANSY_SANITIZED") else 24) << 20
        check(after <= idle + slack, f"RSS {idle} -> {after}")

    run_tests([load])
    srv.check_clean_exit(srv.stop())


# ---------------------------------------------------------------- group: schema

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer"},
    "pet": {"enum": ["cat", "dog", None]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "home": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/place"}]}},
    "required": ["name", "age", "tags"], "additionalProperties": False,
    "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}, "lat": {"type": "number"}},
                        "required": ["city"]}}}

SCHEMA_TOOL = {"type": "function", "function": {"name": "book", "description": "Book a table.", "parameters": {
    "type": "object", "properties": {
        "restaurant": {"type": "string", "minLength": 1},
        "people": {"type": "integer"},
        "outside": {"type": "boolean"},
        "when": {"type": "object", "properties": {"day": {"enum": ["mon", "tue"]}, "hour": {"type": "integer"}},
                 "required": ["day"]},
        "notes": {"type": ["string", "null"]}},
    "required": ["restaurant", "people", "when"]}}}


def group_schema():
    import concurrent.futures
    import jsonschema
    srv = Server("--max-batch", "16", "--ctx-size", "4096")
    cl = srv.client()
    pool = concurrent.futures.ThreadPoolExecutor(16)

    def sampled(k, **kw):
        """Run k: temperature 1, its own seed, thinking off for half the runs (a short reasoning for the rest)."""
        return cl.chat.completions.create(model=MODEL, temperature=1, seed=1000 + k,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": k % 2 == 1}}, **kw)

    def json_schema_50_runs():
        def one(k):
            r = sampled(k, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=120,
                        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                                "strict": True}})
            c = r.choices[0]
            if c.finish_reason == "length":
                return "length"
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
            return c.finish_reason
        results = list(pool.map(one, range(50)))
        print("  json_schema finish reasons:", {x: results.count(x) for x in set(results)})
        check(results.count("stop") >= 10, results)

    def named_tool_50_runs():
        # a short prompt (the demo system prompt would make prefill the cost of this test)
        msgs, tools = [{"role": "user", "content": "Book a table for two at Luigi's on Monday."}], [SCHEMA_TOOL]

        def one(k):
            r = sampled(k, messages=msgs, tools=tools, max_tokens=128,
                        tool_choice={"type": "function", "function": {"name": "book"}},
                        parallel_tool_calls=k % 4 != 0)
            c = r.choices[0]
            if c.finish_reason == "length":
                return "length"
            calls = c.message.tool_calls or []
            check(len(calls) >= 1 and all(t.function.name == "book" for t in calls), c.message)
            check(k % 4 != 0 or len(calls) == 1, "parallel_tool_calls false: one call")
            for t in calls:
                jsonschema.validate(json.loads(t.function.arguments), SCHEMA_TOOL["function"]["parameters"])
            return c.finish_reason
        results = list(pool.map(one, range(50)))
        print("  named tool finish reasons:", {x: results.count(x) for x in set(results)})
        check(results.count("tool_calls") >= 10, results)

    def tools_with_response_format():
        msgs, tools = tool_messages()
        schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        # tool_choice auto: a tool call (pushed by logit_bias on the <tool_call> token) or the JSON
        tok = srv.request("POST", "/tokenize", {"content": "<tool_call>", "parse_special": True})
        ids = json.loads(tok[2])["tokens"] if tok[0] == 200 else []
        kinds = set()
        for k in range(6):
            bias = {str(ids[0]): 100} if ids and k < 3 else {}
            r = cl.chat.completions.create(model=MODEL, messages=msgs, tools=tools, response_format=rf, seed=k,
                                           temperature=1, max_tokens=80, logit_bias=bias,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            c = r.choices[0]
            if c.finish_reason == "length":
                continue
            if c.message.tool_calls:
                kinds.add("tool")
                for t in c.message.tool_calls:
                    params = next(x["function"]["parameters"] for x in tools if x["function"]["name"] == t.function.name)
                    jsonschema.validate(json.loads(t.function.arguments), params)
            else:
                kinds.add("json")
                jsonschema.validate(json.loads(c.message.content), schema)
        check("tool" in kinds, kinds)
        # tool_choice none: JSON only
        r = cl.chat.completions.create(model=MODEL, messages=msgs, tools=tools, response_format=rf, tool_choice="none",
                                       seed=1, temperature=1, max_tokens=80,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        c = r.choices[0]
        check(not c.message.tool_calls, c.message)
        if c.finish_reason != "length":
            jsonschema.validate(json.loads(c.message.content), schema)
        # tool_choice required with a format: a tool call
        r = cl.chat.completions.create(model=MODEL, messages=msgs, tools=tools, response_format=rf, tool_choice="required",
                                       seed=2, temperature=1, max_tokens=120,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        c = r.choices[0]
        check(c.finish_reason == "length" or c.message.tool_calls, c.message)

    def bad_schemas_are_400():
        deep = {"type": "integer"}
        for _ in range(40):
            deep = {"type": "array", "items": deep}
        for schema, needle in ((deep, "deeper"), ({"type": "string", "pattern": "^a"}, "pattern"),
                               ({"$ref": "#/$defs/nope"}, "resolve"), ({"type": "strin"}, "unknown type")):
            s, _, body = srv.request("POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}})
            e = json.loads(body)["error"]
            check(s == 400 and e["param"] == "response_format" and needle in e["message"], (s, body))

    run_tests([bad_schemas_are_400, json_schema_50_runs, named_tool_50_runs, tools_with_response_format])
    pool.shutdown()
    srv.check_clean_exit(srv.stop())


# ---------------------------------------------------------------- group: lifecycle

def group_lifecycle():
    def health_503_while_loading():
        srv = Server(env={"TANSY_TEST_LOAD_DELAY_MS": "2000"}, wait_ready=False)
        s, h, body = srv.request("GET", "/health", auth=False)
        check(s == 503 and json.loads(body)["status"] == "loading" and "retry-after" in h, (s, body))
        s, h, body = srv.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        check(s == 503 and json.loads(body)["error"]["code"] == "model_loading" and "retry-after" in h, (s, body))
        srv.wait_health(200, 60)
        srv.check_clean_exit(srv.stop())

    def graceful_shutdown():
        for sig in (signal.SIGTERM, signal.SIGINT):
            srv = Server("--shutdown-timeout", "20")
            cl = srv.client()
            result = {}

            def long_request():
                s = cl.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=150, temperature=1.0,
                                          seed=3, stream=True)
                text, finish = "", None
                for ch in s:
                    if ch.choices:
                        text += ch.choices[0].text
                        finish = ch.choices[0].finish_reason or finish
                result.update(text=text, finish=finish)

            t = threading.Thread(target=long_request)
            t.start()
            deadline = time.time() + 30
            while srv.metrics()["tansy_active_sequences"] < 1 and time.time() < deadline:
                time.sleep(0.01)
            t0 = time.time()
            srv.proc.send_signal(sig)
            t.join(60)
            rc = srv.stop(sig=None, timeout=60)  # a second signal would mean "exit now"
            check(result.get("finish") in ("stop", "length"), f"in-flight request not finished: {result}")
            srv.check_clean_exit(rc)
            check(time.time() - t0 < 25, "shutdown took too long")
            check(any("shutting down" in l for l in srv.log), "no shutdown log line")
            try:
                srv.request("GET", "/health", timeout=2)
                check(False, "still accepting after shutdown")
            except OSError:
                pass

    def shutdown_deadline_cancels():
        srv = Server("--shutdown-timeout", "0.3")
        cl = srv.client()
        out = {}

        def endless():
            try:
                s = cl.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3000, temperature=1.0,
                                          seed=1, stream=True, extra_body={"stop": []})
                for _ in s:
                    pass
                out["ended"] = "normally"
            except openai.APIError as e:
                out["ended"] = f"error: {e}"

        t = threading.Thread(target=endless)
        t.start()
        deadline = time.time() + 30
        while srv.metrics()["tansy_active_sequences"] < 1 and time.time() < deadline:
            time.sleep(0.01)
        rc = srv.stop()
        t.join(30)
        srv.check_clean_exit(rc)
        check("ended" in out, out)

    def queue_full_gets_429():
        srv = Server("--max-batch", "1", "--max-queue", "1")
        statuses, lock = [], threading.Lock()

        def one(i):
            body = {"prompt": "Once upon a time", "max_tokens": 150, "temperature": 1.0, "seed": i}
            s, h, data = srv.request("POST", "/v1/completions", body)
            with lock:
                statuses.append((s, h.get("retry-after"), json.loads(data)))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        # one runs, one waits: the queue is full, and the official client sees a RateLimitError
        deadline = time.time() + 30
        while srv.metrics()["tansy_queue_depth"] < 1 and time.time() < deadline:
            time.sleep(0.005)
        limited = False
        try:
            srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        except openai.RateLimitError:
            limited = True
        for t in threads:
            t.join(120)
        refused = [x for x in statuses if x[0] == 429]
        check(len(refused) >= 2, [x[0] for x in statuses])
        for s, retry, body in refused:
            check(retry == "1" and body["error"]["code"] == "rate_limit_exceeded", (retry, body))
        check(all(s in (200, 429) for s, _, _ in statuses), [x[0] for x in statuses])
        check(limited or srv.metrics()["tansy_queue_depth"] == 0, "no RateLimitError while the queue was full")
        srv.check_clean_exit(srv.stop())

    def nonstream_disconnect_cancels():
        srv = Server()
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 20000, "temperature": 1.0, "seed": 1})
        for _ in range(3):
            c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            c.request("POST", "/v1/completions", body=body,
                      headers={"Authorization": "Bearer " + API_KEY, "Content-Type": "application/json"})
            deadline = time.time() + 30
            while srv.metrics()["tansy_active_sequences"] < 1 and time.time() < deadline:
                time.sleep(0.01)
            c.close()  # gone before any byte of the response
            deadline = time.time() + 10
            while time.time() < deadline:
                m = srv.metrics()
                if m["tansy_active_sequences"] == 0:
                    break
                time.sleep(0.02)
            check(m["tansy_active_sequences"] == 0 and m["tansy_state_memory_bytes"] == 0,
                  "a non-streamed request whose client left must be cancelled")
        check(srv.metrics()["tansy_client_disconnects_total"] >= 1)
        srv.check_clean_exit(srv.stop())

    run_tests([health_503_while_loading, graceful_shutdown, shutdown_deadline_cancels, queue_full_gets_429,
               nonstream_disconnect_cancels])


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--tansy", required=True)
    p.add_argument("--source-dir", required=True)
    groups = {"api": group_api, "responses": group_responses, "schema": group_schema, "greedy": group_greedy,
              "load": group_load, "lifecycle": group_lifecycle}
    p.add_argument("--group", required=True, choices=list(groups))
    ARGS = p.parse_args()
    t0 = time.time()
    groups[ARGS.group]()
    print(f"{ARGS.group}: {'FAILED ' + ', '.join(FAILURES) if FAILURES else 'all passed'} in {time.time() - t0:.1f} s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
