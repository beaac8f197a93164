#!/usr/bin/env python3
"""Send a two-turn chat to a running server and print what the cache did for each turn.

    python3 scripts/chat_demo.py [--url http://127.0.0.1:8000]

Standard library only. The long system prompt is this machine's textwrap.py source.
"""

import argparse
import json
import textwrap
import urllib.request


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    args = ap.parse_args()
    with urllib.request.urlopen(args.url + "/v1/models") as resp:
        model = json.load(resp)["data"][0]["id"]
    system = open(textwrap.__file__).read()[:12000]
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "What does dedent do?"},
    ]
    for turn in (1, 2):
        reply = post(
            args.url + "/v1/chat/completions",
            {"model": model, "messages": messages, "max_tokens": 32, "temperature": 0},
        )
        usage = reply["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        print(f"turn {turn}: prompt {usage['prompt_tokens']} tokens, cached {cached}")
        messages += [reply["choices"][0]["message"], {"role": "user", "content": "And fill?"}]


if __name__ == "__main__":
    main()
