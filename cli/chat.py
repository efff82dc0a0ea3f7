"""`cellserve chat`: a small terminal client that streams the reply as it comes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx


def stream_reply(client: httpx.Client, url: str, body: dict[str, Any]) -> str:
    parts: list[str] = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text
            raise RuntimeError(f"HTTP {resp.status_code}: {message}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                parts.append(text)
                print(text, end="", flush=True)
    print()
    return "".join(parts)


def run_chat(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    url = args.url.rstrip("/")
    print(f"cellserve chat: {url} (empty line or Ctrl-D to quit)")
    with httpx.Client(headers=headers, timeout=httpx.Timeout(10.0, read=None)) as client:
        while True:
            try:
                user = input("> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if not user:
                return 0
            messages.append({"role": "user", "content": user})
            body: dict[str, Any] = {
                "messages": messages,
                "stream": True,
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
            }
            if args.model:
                body["model"] = args.model
            try:
                reply = stream_reply(client, url, body)
            except (RuntimeError, httpx.HTTPError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": reply})
