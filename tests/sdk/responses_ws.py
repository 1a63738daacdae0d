"""Two turns over the official SDK's Responses WebSocket client.

Usage: responses_ws.py BASE_URL  (the proxy, e.g. http://127.0.0.1:8787)
`client.responses.connect()` opens `GET /v1/responses` with `Upgrade:
websocket`; the second turn sends only its new message and continues the
first with `previous_response_id`, as the WebSocket mode is meant to be
used. Prints one JSON line (each turn's response id and input tokens),
then OK; exits non-zero with a message on the first thing that goes wrong.
"""
import json
import sys

import openai

base = sys.argv[1].rstrip("/")
client = openai.OpenAI(base_url=base + "/v1", api_key="sk-test-sdk-ws", max_retries=0)


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


turns = []
previous = None
# No reconnects: a handshake tidemark dropped must fail here, not be retried.
with client.responses.connect(max_retries=0) as conn:
    for text in ["Say hi.", "And once more, in other words."]:
        args = {"model": "gpt-5", "input": [{"role": "user", "content": text}]}
        if previous is None:
            args["instructions"] = "You are terse."
        else:
            args["previous_response_id"] = previous
        conn.response.create(**args)
        for event in conn:
            if event.type == "error":
                fail(f"error event: {event}")
            if event.type in ("response.failed", "response.incomplete"):
                fail(f"{event.type}: {event}")
            if event.type == "response.completed":
                usage = event.response.usage
                if usage is None:
                    fail("response.completed without usage")
                previous = event.response.id
                turns.append({"id": previous, "input_tokens": usage.input_tokens})
                break

print(json.dumps(turns))
print("OK")
