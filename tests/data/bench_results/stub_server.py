"""A stand-in OpenAI-compatible completions endpoint that the released benchmark clients (vLLM 0.34.0's
``vllm bench serve``, SGLang 0.5.23's ``python -m sglang.bench_serving``) were run against to record the
result files beside this script (see README.md). It is not an engine: it streams one word per token at a
paced rate (a time to first token that grows with the prompt, then one step per token whose length grows
with the number of requests in flight), so that the clients' own writers record well-formed files with
plausible numbers. Nothing in moeplace imports it.

    python stub_server.py PORT
"""
import asyncio
import json
import sys
import time

from aiohttp import web

STEP_S = 0.020  # decode step with one request in flight
STEP_PER_REQ_S = 0.0004  # added per request in flight
PREFILL_S_PER_TOKEN = 4e-6
ACTIVE = 0


async def completions(request: web.Request) -> web.StreamResponse:
    global ACTIVE
    body = await request.json()
    prompt = body.get("prompt") or ""
    prompt_tokens = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
    n = int(body.get("max_tokens") or 16)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    ACTIVE += 1
    try:
        await asyncio.sleep(0.010 + PREFILL_S_PER_TOKEN * prompt_tokens)
        for i in range(n):
            chunk = {"id": "cmpl-stub", "object": "text_completion", "created": int(time.time()),
                     "model": body.get("model"), "choices": [{"index": 0, "text": f" w{i % 50}", "finish_reason":
                                                                None if i < n - 1 else "length"}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(STEP_S + STEP_PER_REQ_S * ACTIVE)
        if (body.get("stream_options") or {}).get("include_usage"):  # as OpenAI-compatible servers do
            usage = {"id": "cmpl-stub", "object": "text_completion", "choices": [],
                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                               "total_tokens": prompt_tokens + n}}
            await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
    finally:
        ACTIVE -= 1
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})


async def ok(request: web.Request) -> web.Response:
    return web.json_response({})


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", ok)
    app.router.add_post("/flush_cache", ok)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]))


if __name__ == "__main__":
    main()
