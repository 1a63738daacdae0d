"""Point the official Anthropic Python SDK at tidemark and read its projection.

    pip install anthropic
    export ANTHROPIC_BASE_URL=http://127.0.0.1:8787   # tidemark (or the URL `tidemark demo --keep-running` prints)
    export ANTHROPIC_API_KEY=sk-ant-...               # any value works against the demo
    python examples/sdk/anthropic_client.py

The SDK reads ANTHROPIC_BASE_URL itself (no /v1: the SDK adds it); tidemark
routes /v1/messages to api.anthropic.com by default.
"""
import os

import anthropic

client = anthropic.Anthropic(
    base_url=os.environ.get("ANTHROPIC_BASE_URL", "http://127.0.0.1:8787"),
    default_headers={"x-session-id": "sdk-example-anthropic"},  # optional: name the session
)

# with_raw_response exposes the HTTP headers next to the parsed result.
raw = client.messages.with_raw_response.create(
    model=os.environ.get("MODEL", "claude-sonnet-4-5"),
    max_tokens=256,
    messages=[{"role": "user", "content": "Say hello in Japanese."}],
)
print("x-context-projection:", raw.headers.get("x-context-projection"))
if raw.headers.get("x-context-warning"):
    print("x-context-warning:   ", raw.headers.get("x-context-warning"))
message = raw.parse()
print(message.content[0].text)

# Streaming: the header arrives with the response, before the first event.
with client.messages.with_streaming_response.create(
    model=os.environ.get("MODEL", "claude-sonnet-4-5"),
    max_tokens=256,
    messages=[{"role": "user", "content": "Count to five."}],
    stream=True,
) as resp:
    print("x-context-projection (stream):", resp.headers.get("x-context-projection"))
    for event in resp.parse():
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            print(event.delta.text, end="", flush=True)
    print()
