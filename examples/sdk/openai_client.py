"""Point the official OpenAI Python SDK at tidemark and read its projection.

    pip install openai
    export OPENAI_BASE_URL=http://127.0.0.1:8787/v1   # tidemark (or the URL `tidemark demo --keep-running` prints)
    export OPENAI_API_KEY=sk-...                      # any value works against the demo
    python examples/sdk/openai_client.py

The SDK reads OPENAI_BASE_URL itself; nothing else changes in your agent.
"""
import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8787/v1"),
    default_headers={"x-session-id": "sdk-example-openai"},  # optional: name the session
)

# with_raw_response exposes the HTTP headers next to the parsed result.
raw = client.chat.completions.with_raw_response.create(
    model=os.environ.get("MODEL", "gpt-4o"),
    messages=[{"role": "user", "content": "Say hello in Japanese."}],
)
print("x-context-projection:", raw.headers.get("x-context-projection"))
if raw.headers.get("x-context-warning"):
    print("x-context-warning:   ", raw.headers.get("x-context-warning"))
completion = raw.parse()
print(completion.choices[0].message.content)

# Streaming: the header arrives with the response, before the first token.
with client.chat.completions.with_streaming_response.create(
    model=os.environ.get("MODEL", "gpt-4o"),
    messages=[{"role": "user", "content": "Count to five."}],
    stream=True,
) as resp:
    print("x-context-projection (stream):", resp.headers.get("x-context-projection"))
    for chunk in resp.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
