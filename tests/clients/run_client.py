#!/usr/bin/env python3
"""Runs one real client library against `tansy serve` (ctest label: clients).

Each client has a pinned requirements file (requirements/<client>.txt: today's release of that library, bumped
on purpose) and a check script (check_<client>.py) run with that venv's python. The venv lives in the build tree
and is rebuilt only when its requirements file changes. The server is the bundled tiny model on the CPU backend,
started on a free loopback port; the checks test protocol (the library parses what we send, round trips
complete), not answer quality.

Usage: run_client.py --tansy build/bin/tansy --client openai --venv-root build/client-venvs
"""
import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
API_KEY = "sk-tansy-clients"


def ensure_venv(root, client):
    """The client's venv, (re)built when its requirements file changed. Returns its python."""
    req = os.path.join(HERE, "requirements", client + ".txt")
    with open(req, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    venv = os.path.join(root, client)
    py = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, "requirements.sha256")
    if os.path.exists(stamp) and open(stamp).read() == digest and os.path.exists(py):
        return py
    shutil.rmtree(venv, ignore_errors=True)
    t0 = time.time()
    subprocess.check_call([sys.executable, "-m", "venv", venv])
    subprocess.check_call([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
                           "-r", req])
    with open(stamp, "w") as f:
        f.write(digest)
    print(f"run_client: venv for {client} built in {time.time() - t0:.0f} s", flush=True)
    return py


class Server:
    """`tansy serve --port 0` on the bundled model; the port is read from its log."""

    def __init__(self, tansy, extra):
        cmd = [tansy, "serve", "--port", "0", "--threads", "1", "--api-key", API_KEY] + extra
        env = dict(os.environ)
        env.pop("TANSY_MODEL", None)
        self.log = []
        self.port = None
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     errors="replace", env=env)
        got = threading.Event()

        def reader():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on http://[0-9.]+:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    got.set()
            got.set()

        threading.Thread(target=reader, daemon=True).start()
        if not got.wait(60) or self.port is None:
            self.stop()
            raise SystemExit("run_client: the server did not start:\n" + "".join(self.log))
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit("run_client: the server exited:\n" + "".join(self.log))
            time.sleep(0.1)
        raise SystemExit("run_client: /health never answered 200")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tansy", required=True)
    p.add_argument("--client", required=True)
    p.add_argument("--venv-root", required=True)
    a = p.parse_args()
    py = ensure_venv(a.venv_root, a.client)
    srv = Server(a.tansy, [])
    env = dict(os.environ)
    env.update({
        "TANSY_BASE_URL": f"http://127.0.0.1:{srv.port}/v1",
        "TANSY_API_KEY": API_KEY,
        "TANSY_MODEL_NAME": "tiny-chat-q4",
        # no telemetry, no tracing exports, no network besides the loopback server
        "OPENAI_AGENTS_DISABLE_TRACING": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LLM_USER_PATH": os.path.join(a.venv_root, a.client + "-llm-home"),
    })
    t0 = time.time()
    try:
        rc = subprocess.call([py, os.path.join(HERE, "check_" + a.client + ".py")], env=env, timeout=400)
    finally:
        srv.stop()
    if rc != 0:
        print("run_client: server log tail:\n" + "".join(srv.log[-40:]), flush=True)
    print(f"run_client: {a.client}: {'passed' if rc == 0 else 'FAILED'} in {time.time() - t0:.1f} s", flush=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
