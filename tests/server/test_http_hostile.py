#!/usr/bin/env python3
"""`tansy serve` against hostile or careless clients (issue 29), over raw loopback sockets; standard library only.

Starts the server (embedded tiny model, CPU backend) with --cors-origin, then: a burst of 64 simultaneous
connections, 300 slow clients trickling headers while a normal request is answered in < 3 s, huge and negative
Content-Length answered at once, an HTTP/1.0 streamed chat completion readable without chunking, PUT -> 405 with
Allow, CORS headers and an OPTIONS preflight, malformed request lines and oversized headers; finally a clean
SIGTERM exit. Every wait is bounded; the whole run takes a few seconds.

Usage: test_http_hostile.py --tansy build/bin/tansy
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

ORIGIN = "http://app.example"
TIMEOUT_S = 10  # per socket operation; nothing here should come near it


# RSS after the suite may exceed the idle RSS by this much: glibc keeps some freed memory in its arenas (a leak of
# the ~400 connections' buffers or of a request's state would be tens of MiB more)
RSS_MARGIN_MIB = 16


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
    return s


def read_all(s):
    out = b""
    while True:
        try:
            b = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not b:
            break
        out += b
    return out


def roundtrip(port, raw):
    with connect(port) as s:
        s.sendall(raw)
        return read_all(s)


def status(resp):
    m = re.match(rb"HTTP/1\.[01] (\d{3})", resp)
    return int(m.group(1)) if m else 0


def head_and_body(resp):
    h, _, b = resp.partition(b"\r\n\r\n")
    return h.decode("latin-1"), b


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tansy", required=True)
    args = p.parse_args()
    proc = subprocess.Popen([args.tansy, "serve", "--port", "0", "--threads", "1", "-q", "--cors-origin", ORIGIN],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    port, log = None, []
    t_start = time.time()
    for line in proc.stderr:  # bounded by the server printing "ready" (or exiting)
        log.append(line)
        m = re.search(r"listening on http://[0-9.]+:(\d+)", line)
        if m:
            port = int(m.group(1))
        if "ready:" in line or time.time() - t_start > 120:
            break
    threading.Thread(target=lambda: [log.append(x) for x in proc.stderr], daemon=True).start()
    failures = []

    def check(name, cond, detail=""):
        print(f"{'PASS' if cond else 'FAIL'} {name}" + ("" if cond else f": {detail!r}"[:600]), flush=True)
        if not cond:
            failures.append(name)

    def rss_kib():
        with open(f"/proc/{proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))

    try:
        if port is None:
            raise AssertionError("server did not start:\n" + "".join(log))
        get_health = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        # the idle footprint once a request has run (buffers of a step, the allocator's first arenas)
        warm = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
        roundtrip(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(warm), warm))
        time.sleep(0.3)
        idle_kib = rss_kib()

        # 1. a burst of 64 connections, all connected before any request is sent
        t0 = time.time()
        socks = [connect(port) for _ in range(64)]
        for s in socks:
            s.sendall(get_health)
        answered = sum(status(read_all(s)) == 200 for s in socks)
        for s in socks:
            s.close()
        check("burst_64_all_answered", answered == 64 and time.time() - t0 < 3, (answered, time.time() - t0))

        # 2. 300 slow clients trickle their headers; a normal request is still answered at once
        slow = []
        for _ in range(300):
            s = connect(port)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHo")
            slow.append(s)
        stop = threading.Event()

        def trickle():
            for _ in range(50):  # at most ~5 s
                if stop.is_set():
                    return
                for s in slow:
                    try:
                        s.send(b"s")
                    except OSError:
                        pass
                time.sleep(0.1)

        th = threading.Thread(target=trickle)
        th.start()
        time.sleep(0.3)
        t0 = time.time()
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
        r = roundtrip(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        took = time.time() - t0
        stop.set()
        th.join()
        for s in slow:
            s.close()
        check("slow_clients_do_not_block", status(r) == 200 and took < 3, (status(r), took, r[:300]))

        # 3. Content-Length: huge -> 413, negative or malformed -> 400, without waiting for a body
        for cl, want in ((b"99999999999999", 413), (b"-1", 400), (b"abc", 400)):
            t0 = time.time()
            r = roundtrip(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %s\r\n\r\n" % cl)
            ok = status(r) == want and time.time() - t0 < 1 and "error" in json.loads(head_and_body(r)[1])
            check(f"content_length_{cl.decode()}", ok, (time.time() - t0, r[:300]))

        # 4. HTTP/1.0: a streamed completion is not chunked; it ends when the server closes
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}).encode()
        r = roundtrip(port, b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        h, b = head_and_body(r)
        events = [line for line in b.decode().split("\n\n") if line.startswith("data: ")]
        check("http10_stream_unchunked", status(r) == 200 and "transfer-encoding" not in h.lower()
              and events and events[-1] == "data: [DONE]" and all(json.loads(e[6:])["object"] == "chat.completion.chunk"
                                                                   for e in events[:-1]), r[:600])

        # 5. a known path with another method: 405 with Allow
        r = roundtrip(port, b"PUT /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        h, _ = head_and_body(r)
        check("put_405_allow", status(r) == 405 and re.search(r"(?im)^allow: POST, OPTIONS\r?$", h), r[:300])

        # 6. CORS: the allowed origin gets Access-Control-Allow-Origin; a preflight is answered
        r = roundtrip(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nOrigin: %s\r\nConnection: close\r\n\r\n" % ORIGIN.encode())
        h, _ = head_and_body(r)
        check("cors_allowed_origin", status(r) == 200 and f"Access-Control-Allow-Origin: {ORIGIN}" in h, r[:300])
        r = roundtrip(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nOrigin: http://evil.example\r\nConnection: close\r\n\r\n")
        check("cors_other_origin", "Access-Control-Allow-Origin" not in head_and_body(r)[0], r[:300])
        r = roundtrip(port, b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: %s\r\n"
                            b"Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n"
                            b"Connection: close\r\n\r\n" % ORIGIN.encode())
        h, _ = head_and_body(r)
        check("cors_preflight", status(r) == 204 and f"Access-Control-Allow-Origin: {ORIGIN}" in h
              and "Access-Control-Allow-Methods: POST" in h and "Access-Control-Allow-Headers: content-type" in h, r[:400])

        # 7. malformed request lines and oversized headers
        for name, raw, want in (("garbage", b"\x16\x03\x01garbage\r\n\r\n", 400),
                                ("no_version", b"GET /health\r\n\r\n", 400),
                                ("http2", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
                                ("huge_header", b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100000 + b"\r\n\r\n", 431)):
            r = roundtrip(port, raw)
            check(f"malformed_{name}", status(r) == want, r[:200])
        r = roundtrip(port, get_health)
        check("still_serving", status(r) == 200, r[:200])
        # back to idle: the connections' buffers and the requests' state are all given back. Under ASan freed
        # memory sits in quarantine, so only the plain build is held to it.
        time.sleep(0.5)
        grown_mib = (rss_kib() - idle_kib) / 1024
        print(f"rss: idle {idle_kib / 1024:.1f} MiB, after the suite +{grown_mib:.1f} MiB", flush=True)
        if os.environ.get("TANSY_SANITIZED", "0") in ("0", "", "FALSE", "false"):
            check("rss_back_to_idle", grown_mib <= RSS_MARGIN_MIB, grown_mib)
    except Exception as e:  # noqa: BLE001 - report and fail
        failures.append(f"exception {e!r}")
        print(f"FAIL {e!r}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    if rc != 0:
        failures.append(f"exit status {rc}")
    print(f"hostile: {'FAILED ' + ', '.join(failures) if failures else 'all passed'}")
    if failures:
        print("".join(log)[-4000:])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
