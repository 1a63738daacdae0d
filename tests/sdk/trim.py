"""The official SDKs send a long tool-using conversation through tidemark
with --on-over trim: the call succeeds, the SDK parses the answer, and the
response carries x-context-trimmed with before > after.

Usage: trim.py BASE_URL  (BASE_URL = the proxy)
Exits non-zero with a message on the first expectation that does not hold.
"""
import sys

import anthropic
import openai

base = sys.argv[1].rstrip("/")
TURNS = 30


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def filler(seed, lines):
    return "".join(f"line {seed}.{i}: fn tide_{seed}_{i}() -> u{i} {{ {seed * i} }}\n"
                   for i in range(lines))


def trimmed(headers, who):
    h = headers.get("x-context-trimmed")
    if not h:
        fail(f"{who}: no x-context-trimmed")
    fields = dict(kv.strip().split("=", 1) for kv in h.split(","))
    if set(fields) != {"before", "after", "turns", "tool-results"}:
        fail(f"{who}: x-context-trimmed {h!r}")
    if not int(fields["before"]) > int(fields["after"]):
        fail(f"{who}: trim did not shrink: {h!r}")


# OpenAI chat: tool_calls and tool messages.
msgs = [{"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "Look at the repository. " + filler(0, 5)}]
for t in range(TURNS):
    msgs.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{t}", "type": "function",
         "function": {"name": "read_file", "arguments": '{"path":"src/lib.rs"}'}}]})
    msgs.append({"role": "tool", "tool_call_id": f"call_{t}", "content": filler(t, 12)})
    msgs.append({"role": "assistant", "content": f"Turn {t} read. " + filler(t + 100, 2)})
    msgs.append({"role": "user", "content": f"Question {t + 1}: " + filler(t + 200, 2)})
tools = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
oa = openai.OpenAI(base_url=base + "/v1", api_key="sk-test-sdk", max_retries=0)
raw = oa.chat.completions.with_raw_response.create(
    model="gpt-4o-sdktrim", messages=msgs, tools=tools,
    extra_headers={"x-session-id": "sdk-trim-chat"})
trimmed(raw.headers, "openai chat")
if raw.parse().choices[0].message.content != "ok":
    fail("openai chat: answer not parsed")

# Anthropic: tool_use / tool_result blocks, strict alternation.
amsgs = [{"role": "user", "content": "Look at the repository. " + filler(0, 5)}]
for t in range(TURNS):
    amsgs.append({"role": "assistant", "content": [
        {"type": "text", "text": "Reading."},
        {"type": "tool_use", "id": f"toolu_{t}", "name": "read_file",
         "input": {"path": "src/lib.rs"}}]})
    amsgs.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": f"toolu_{t}", "content": filler(t, 12)},
        {"type": "text", "text": f"Question {t + 1}: " + filler(t + 200, 2)}]})
an = anthropic.Anthropic(base_url=base, api_key="sk-ant-test-sdk", max_retries=0)
raw = an.messages.with_raw_response.create(
    model="claude-sdktrim", max_tokens=64, system="You are a careful coding agent.",
    tools=[{"name": "read_file", "description": "read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
    messages=amsgs, extra_headers={"x-session-id": "sdk-trim-anthropic"})
trimmed(raw.headers, "anthropic")
if raw.parse().content[0].text != "ok":
    fail("anthropic: answer not parsed")

print("OK")
