"""The issue-10 case through the real CLI: ``sparseinfer serve -np N -t 1``, 12 concurrent
non-streamed completions of 32 tokens; prints the wall time, /health during the run, a 400 from
``--max-tokens-limit`` and the /metrics counters.

    python benchmarks/serve_issue10.py [N]     # N: --parallel (default 4)
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("parallel", nargs="?", type=int, default=4, help="the server's -np (default 4)")
args = ap.parse_args()
env = dict(os.environ, PYTHONPATH="src")
p = subprocess.Popen([sys.executable, "-m", "sparseinfer", "serve", "--port", "0", "-np", str(args.parallel),
                      "-t", "1", "--max-tokens-limit", "64"], stderr=subprocess.PIPE, text=True, env=env)
port = None
t0 = time.time()
while port is None and time.time() - t0 < 200:
    line = p.stderr.readline()
    if not line: break
    m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
    if m: port = int(m.group(1))
print("port", port)
base = f"http://127.0.0.1:{port}"
res = []
def ask(i):
    t = time.time()
    r = httpx.post(base + "/v1/completions", json={"prompt": f"Story {i}:", "max_tokens": 32, "temperature": 0.7, "seed": i}, timeout=120)
    res.append((i, r.status_code, r.json()["usage"]["completion_tokens"], round(time.time() - t, 1)))
ts = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
t = time.time(); [x.start() for x in ts]
time.sleep(2); print(httpx.get(base + "/health").json())
[x.join() for x in ts]
print("12 x 32 tokens in %.1f s" % (time.time() - t), sorted(res))
print(httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 65}).json())
print([l for l in httpx.get(base + "/metrics").text.splitlines() if l.startswith("sparseinfer_requests_total") or l.startswith("sparseinfer_generated")])
p.send_signal(signal.SIGINT); p.wait(30); print("rc", p.returncode)
