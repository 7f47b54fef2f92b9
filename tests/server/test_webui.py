#!/usr/bin/env python3
"""The chat page at GET / of `tansy serve`, driven in a real headless browser (ctest: server.webui, label server).

Starts `tansy serve --port 0` on the bundled tiny model (CPU) with an API key, and Debian's chromium through
Selenium and the system chromedriver (scripts/install-deps.sh installs both) at a phone's width:
  - GET / is public, text/html; the page loads nothing from elsewhere and does not overflow sideways
  - a message typed and sent streams an answer (thinking off, key from the settings panel) with tokens/s
  - a long answer (ignore_eos, injected into the page's fetch by the test) stopped soon after it starts: the
    page is usable again, the partial answer is kept, and the server counts a client disconnect
  - the conversation survives a reload (localStorage); New chat clears it
  - thinking on, the demo tools (injected like ignore_eos) and their system message: the reasoning shows in a
    <details> block and the tool call as a block with its name and arguments
  - with --no-webui, GET / is 404
Usage: test_webui.py --tansy build/bin/tansy --screenshot build/webui-screenshot.png
"""
import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

CHROMEDRIVER = "/usr/bin/chromedriver"
DEMO_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models", "tiny-chat-q4",
                          "demo_tools.json")
API_KEY = "sk-webui-test"
WAIT_S = 60  # the longest any one step may take (the tiny model answers in well under a second on a CPU)


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def find_chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Server:
    """`tansy serve --port 0` in the background; the port is read from its log."""

    def __init__(self, tansy, *extra, wait_ready=True):
        cmd = [tansy, "serve", "--port", "0", "--threads", "1", "--api-key", API_KEY] + list(extra)
        env = dict(os.environ, TANSY_MODEL="")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True,
                                     errors="replace")
        self.log, self.port = [], None
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
        if not got_port.wait(WAIT_S) or self.port is None:
            self.stop()
            fail("server did not start:\n" + "".join(self.log))
        if wait_ready:
            deadline = time.time() + WAIT_S
            while self.request("GET", "/health")[0] != 200:
                if time.time() > deadline or self.proc.poll() is not None:
                    fail("server never became ready:\n" + "".join(self.log))
                time.sleep(0.05)

    def url(self, path="/"):
        return f"http://127.0.0.1:{self.port}{path}"

    def request(self, method, path, auth=False):
        """Raw HTTP: (status, headers lower-cased, body); status 0 when the connection fails."""
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            c.request(method, path, headers={"Authorization": "Bearer " + API_KEY} if auth else {})
            r = c.getresponse()
            body = r.read()
            c.close()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, body
        except OSError:
            return 0, {}, b""

    def metric(self, name):
        status, _, body = self.request("GET", "/metrics", auth=True)
        if status != 200:
            fail(f"/metrics: {status}")
        m = re.search(r"^" + re.escape(name) + r" (\S+)$", body.decode(), re.M)
        return float(m.group(1)) if m else None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.reader.join(5)
        return rc


def wait_for(what, cond, timeout=WAIT_S, poll=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(poll)
    fail(f"timed out after {timeout} s waiting for {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tansy", required=True)
    ap.add_argument("--screenshot", required=True)
    args = ap.parse_args()
    t0 = time.time()

    chromium = find_chromium()
    if not chromium or not os.access(CHROMEDRIVER, os.X_OK):
        fail("this test needs Debian's chromium and chromedriver (packages chromium, chromium-driver): "
             "run scripts/install-deps.sh")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
    except ImportError:
        fail("the server test venv lacks selenium (ctest runs server.venv first, which installs it)")

    srv = Server(args.tansy)
    driver = None
    try:
        # 1. the page itself: public (no key), HTML, self-contained
        status, headers, body = srv.request("GET", "/")
        if status != 200 or headers.get("content-type") != "text/html; charset=utf-8":
            fail(f"GET /: {status} {headers}")
        page = body.decode()
        for needle in ('id="input"', 'id="send"', 'id="stop"', 'id="new-chat"'):
            if needle not in page:
                fail(f"GET /: the page has no {needle}")
        if re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page):
            fail("the page refers to another origin")

        os.environ.setdefault("SE_OFFLINE", "true")  # selenium must not look for (or download) browsers
        opts = webdriver.ChromeOptions()
        opts.binary_location = chromium
        for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
            opts.add_argument(a)
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
        # a phone's screen (headless windows are at least 500 px wide): the layout must hold there
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True})
        driver.set_script_timeout(10)
        driver.get(srv.url("/"))
        q = lambda css: driver.find_element(By.CSS_SELECTOR, css)
        qs = lambda css: driver.find_elements(By.CSS_SELECTOR, css)
        if driver.execute_script("return document.documentElement.scrollWidth > window.innerWidth + 1"):
            fail("the page overflows sideways at 390 px")

        # 2. settings: the key, thinking off (the tiny model thinks at length otherwise), a short answer
        q("#toggle-settings").click()
        q("#api-key").send_keys(API_KEY)
        if q("#thinking").is_selected():
            q("#thinking").click()
        q("#temperature").send_keys("0")
        q("#max-tokens").send_keys("40")

        def assistant(n):
            """The n-th assistant message as a dict, or None. note: read in one script, since the page re-renders
            a message while it streams (element handles would go stale)."""
            return driver.execute_script("""
                const m = document.querySelectorAll(".msg.assistant")[arguments[0] - 1];
                if (!m) return null;
                const text = (css) => [...m.querySelectorAll(css)].map((e) => e.textContent.trim());
                return {done: m.dataset.done === "1", error: m.classList.contains("error"), all: m.innerText,
                        answer: text(".answer").join(""), stats: text(".stats").join(""),
                        reasoning: text("details.reasoning div").join(""), tools: text(".tool"),
                        send: !document.getElementById("send").disabled,
                        stop: !document.getElementById("stop").disabled};""", n)

        def answered(n):
            """The n-th assistant message once its request has finished (send usable again), else None."""
            m = assistant(n)
            return m if m and m["done"] and m["send"] else None

        def inject(fields):  # adds fields to the page's own requests (reset by a reload)
            driver.execute_script("""
                const f = window.fetch, extra = arguments[0];
                window.fetch = (url, o) => {
                  const b = Object.assign(JSON.parse(o.body), extra); o.body = JSON.stringify(b); return f(url, o);
                };""", fields)

        q("#input").send_keys("What does json.dumps do?")
        q("#send").click()
        m1 = wait_for("the first answer", lambda: answered(1))
        a1, stats1 = m1["answer"], m1["stats"]
        if not a1 or m1["error"]:
            fail(f"first answer empty or an error: {m1['all']!r}")
        if "tokens" not in stats1:
            fail(f"first answer: no token count in {stats1!r}")
        print(f"answer 1 ({stats1}): {a1[:80]!r}")

        # 3. a long answer stopped soon after it starts. note: ignore_eos is added to the page's own request
        # by wrapping fetch, so the answer cannot end by itself before Stop is pressed
        inject({"ignore_eos": True})
        disconnects = srv.metric("tansy_client_disconnects_total") or 0
        q("#max-tokens").clear()
        q("#max-tokens").send_keys("4000")
        q("#input").send_keys("Write a long story about a heap.")
        q("#input").send_keys(Keys.ENTER)  # Enter sends
        started = wait_for("the second answer to start", lambda: (assistant(2) or {}).get("answer") and assistant(2))
        if not started["stop"] or started["send"]:
            fail(f"while answering: Stop should be enabled and Send disabled: {started}")
        q("#stop").click()
        m2 = wait_for("the stopped answer to settle", lambda: answered(2), timeout=10)
        a2 = m2["answer"]
        if not a2 or "stopped" not in m2["stats"] or m2["error"]:
            fail(f"stopped answer not kept or not marked: {m2['all']!r}")
        if m2["stop"]:
            fail("Stop still enabled after stopping")
        wait_for("the server to cancel the stopped request",
                 lambda: srv.metric("tansy_client_disconnects_total") > disconnects and
                 srv.metric("tansy_active_sequences") == 0, timeout=10)
        print(f"answer 2 stopped after {len(a2)} characters")
        driver.save_screenshot(args.screenshot)

        # 4. kept in localStorage across a reload; New chat clears it
        driver.refresh()
        msgs = wait_for("the conversation after a reload", lambda: len(qs(".msg.assistant")) == 2 and qs(".msg"))
        if len(msgs) != 4 or assistant(2)["answer"] != a2:
            fail(f"conversation not restored: {[m.text for m in msgs]}")
        q("#new-chat").click()
        if qs(".msg"):
            fail("New chat left messages on the page")
        driver.refresh()
        if qs(".msg"):
            fail("New chat did not clear the stored conversation")
        if not q("#send").is_enabled():
            fail("Send disabled on a fresh page")

        # 5. reasoning and a tool call (the settings were kept across the reloads; the panel starts closed)
        with open(DEMO_TOOLS) as f:
            demo = json.load(f)
        inject({"tools": demo["tools"]})
        q("#toggle-settings").click()
        if q("#api-key").get_attribute("value") != API_KEY or q("#thinking").is_selected():
            fail("settings not kept across a reload")
        q("#system").send_keys(demo["system"])
        q("#thinking").click()
        q("#max-tokens").clear()
        q("#max-tokens").send_keys("300")
        q("#input").send_keys("Use a tool to find out what heapq.heappush does.")
        q("#send").click()
        m3 = wait_for("the tool call answer", lambda: answered(1))
        if not m3["reasoning"]:
            fail(f"thinking on: no reasoning block in {m3}")
        tools = m3["tools"]
        if len(tools) != 1 or "get_docstring" not in tools[0] or "heapq.heappush" not in tools[0]:
            fail(f"no tool call block with get_docstring(heapq.heappush) in {m3}")
        print(f"tool call: {tools[0]!r}")
        logs = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        if logs:
            fail(f"browser console errors: {logs}")
    finally:
        if driver:
            driver.quit()
        rc = srv.stop()
    if rc != 0:
        fail(f"server exit status {rc}:\n{''.join(srv.log)[-4000:]}")

    # 6. --no-webui: no page
    off = Server(args.tansy, "--no-webui", wait_ready=False)
    status = off.request("GET", "/")[0]
    off.stop()
    if status != 404:
        fail(f"--no-webui: GET / answered {status}, expected 404")
    print(f"ok: webui test passed in {time.time() - t0:.1f} s; screenshot {args.screenshot}")


if __name__ == "__main__":
    main()
