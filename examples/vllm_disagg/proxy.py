"""A disaggregated-serving proxy for vLLM engines that use kvsvc's connector: OpenAI `/v1/completions` in front of
one prefill (P) and one decode (D) engine.

For each request it asks P for one token with `kv_transfer_params={"do_remote_decode": true}`, then sends the
client's request to D with the `kv_transfer_params` P returned, unchanged, and streams D's answer back. This is
vLLM's remote-prefill convention: any router that follows it works the same with kvsvc. Run:

    python examples/vllm_disagg/proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import copy
import logging
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("proxy")
ENGINES: web.AppKey[dict[str, str]] = web.AppKey("engines", dict)
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)


async def completions(request: web.Request) -> web.StreamResponse:
    body: dict[str, Any] = await request.json()
    engines, session = request.app[ENGINES], request.app[SESSION]
    prefill = copy.deepcopy(body)
    prefill.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    prefill.pop("stream_options", None)
    async with session.post(f"{engines['prefill']}/v1/completions", json=prefill) as response:
        answer = await response.json()
        if response.status != 200:
            return web.json_response(answer, status=response.status)
    params = answer.get("kv_transfer_params")
    if not params:
        return web.json_response({"error": "the prefill engine returned no kv_transfer_params"}, status=502)
    decode = {**body, "kv_transfer_params": params}
    async with session.post(f"{engines['decode']}/v1/completions", json=decode) as response:
        if not body.get("stream"):
            return web.json_response(await response.json(), status=response.status)
        stream = web.StreamResponse(status=response.status, headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        async for chunk in response.content.iter_any():
            await stream.write(chunk)
        await stream.write_eof()
        return stream


async def models(request: web.Request) -> web.Response:
    async with request.app[SESSION].get(f"{request.app[ENGINES]['decode']}/v1/models") as response:
        return web.json_response(await response.json(), status=response.status)


def build_app(prefill: str, decode: str) -> web.Application:
    app = web.Application()
    app[ENGINES] = {"prefill": prefill.rstrip("/"), "decode": decode.rstrip("/")}

    async def session(app: web.Application) -> Any:
        app[SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="base URL of the prefill engine")
    parser.add_argument("--decode", required=True, help="base URL of the decode engine")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    web.run_app(build_app(args.prefill, args.decode), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
