"""How long /health takes while a server computes one long prompt: a client sends a prompt of
`--words` words (max_tokens 1) and polls /health every `--every` seconds until it finishes.

    python -m bench.health_probe --base-url http://127.0.0.1:8000

A server whose event loop waits for the model's step answers after the step (seconds on a real
model); docs/reliability.md has the figures before and after the kernels released the GIL.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--words", type=int, default=2000)
    p.add_argument("--every", type=float, default=0.05, help="seconds between probes")
    args = p.parse_args()
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(args.words))
    done = threading.Event()
    took: list[float] = []

    def long_request() -> None:
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(
            args.base_url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        t = time.perf_counter()
        try:
            urllib.request.urlopen(req, timeout=600).read()
        finally:
            took.append(time.perf_counter() - t)
            done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.3)  # the request is in
    lat: list[float] = []
    while not done.is_set():
        t = time.perf_counter()
        urllib.request.urlopen(args.base_url + "/health", timeout=600).read()
        lat.append(time.perf_counter() - t)
        time.sleep(args.every)
    thread.join()
    print(f"prompt request {took[0]:.2f} s")
    if not lat:
        print("/health: no probe while the prompt ran (it finished within 0.3 s)")
        return
    lat.sort()
    print(
        f"/health during the prompt: {len(lat)} probes, p50 {lat[len(lat) // 2] * 1e3:.1f} ms, "
        f"max {lat[-1] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
