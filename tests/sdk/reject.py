"""The official SDKs see tidemark's rejections as their own provider's errors.

Usage: reject.py BASE_URL  (BASE_URL = the proxy, e.g. http://127.0.0.1:8787)
Exits non-zero with a message on the first expectation that does not hold.
"""
import re
import sys

import anthropic
import openai

base = sys.argv[1].rstrip("/")
big = "tidemark " * 4000  # far over the tiny windows the test configures

def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)

# OpenAI chat: BadRequestError, code context_length_exceeded, no retry.
oa = openai.OpenAI(base_url=base + "/v1", api_key="sk-test-sdk", max_retries=2)
try:
    oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": big}])
    fail("openai chat: request over the window was not rejected")
except openai.BadRequestError as e:
    if e.code != "context_length_exceeded":
        fail(f"openai chat: code {e.code!r}")
    if e.response.headers.get("x-tidemark-error") != "context-budget":
        fail("openai chat: x-tidemark-error missing")
    if "src=" not in e.response.headers.get("x-context-projection", ""):
        fail("openai chat: x-context-projection missing")

# OpenAI Responses: same error shape.
try:
    oa.responses.create(model="gpt-4o", input=big)
    fail("openai responses: request over the window was not rejected")
except openai.BadRequestError as e:
    if e.code != "context_length_exceeded":
        fail(f"openai responses: code {e.code!r}")

# Anthropic: BadRequestError, "prompt is too long: P tokens > W maximum".
an = anthropic.Anthropic(base_url=base, api_key="sk-ant-test-sdk", max_retries=2)
try:
    an.messages.create(model="claude-sonnet-4-5", max_tokens=64,
                       messages=[{"role": "user", "content": big}])
    fail("anthropic: request over the window was not rejected")
except anthropic.BadRequestError as e:
    msg = e.body["error"]["message"] if isinstance(e.body, dict) else str(e)
    if not re.fullmatch(r"prompt is too long: \d+ tokens > \d+ maximum", msg):
        fail(f"anthropic: message {msg!r}")
    if e.body.get("error", {}).get("type") != "invalid_request_error":
        fail("anthropic: error type")

print("OK")
