"""A disaggregated-serving proxy for vLLM engines that use kvsvc's connector: OpenAI `/v1/completions` and
`/v1/chat/completions` in front of one or more prefill (P) and decode (D) servers.

For each request it picks the next P server and the next D server (round robin, each list on its own, as vLLM's own
toy proxy does), asks P for one token with `kv_transfer_params={"do_remote_decode": true}`, then sends the client's
request to D with the `kv_transfer_params` P returned, unchanged, and streams D's answer back. This is vLLM's
remote-prefill convention: any router that follows it works the same with kvsvc. A P server may run several
data-parallel ranks: the one that served the prefill is named in the params it returns, so D asks the right one.
Run:

    python examples/vllm_disagg/proxy.py --prefill http://127.0.0.1:8100 --prefill http://127.0.0.1:8101 \
        --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("proxy")
PREFILLS: web.AppKey[Iterator[str]] = web.AppKey("prefills")
DECODES: web.AppKey[Iterator[str]] = web.AppKey("decodes")
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)
FIRST_DECODE: web.AppKey[str] = web.AppKey("first_decode", str)


def _one_token(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request: the client's, asking for one token, not streamed, with the remote-decode flag."""
    prefill = copy.deepcopy(body)
    prefill.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in prefill:  # the chat API's name for it
        prefill["max_completion_tokens"] = 1
    prefill.pop("stream_options", None)
    return prefill


async def _disaggregated(request: web.Request, path: str) -> web.StreamResponse:
    body: dict[str, Any] = await request.json()
    app = request.app
    prefills, decodes = app[PREFILLS], app[DECODES]
    session, prefill_url, decode_url = app[SESSION], next(prefills), next(decodes)
    async with session.post(f"{prefill_url}{path}", json=_one_token(body)) as response:
        answer = await response.json()
        if response.status != 200:
            return web.json_response(answer, status=response.status)
    params = answer.get("kv_transfer_params")
    if params:
        log.info("prefill %s -> decode %s (P engine %s)", prefill_url, decode_url, params.get("remote_engine_id"))
    else:  # P holds nothing for D (a one-token prompt of a Mamba model): D computes the prompt itself
        log.info("prefill %s held nothing: decode %s computes the prompt", prefill_url, decode_url)
    decode = {**body, "kv_transfer_params": params}
    async with session.post(f"{decode_url}{path}", json=decode) as response:
        if not body.get("stream"):
            return web.json_response(await response.json(), status=response.status)
        stream = web.StreamResponse(status=response.status, headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        async for chunk in response.content.iter_any():
            await stream.write(chunk)
        await stream.write_eof()
        return stream


async def completions(request: web.Request) -> web.StreamResponse:
    return await _disaggregated(request, "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _disaggregated(request, "/v1/chat/completions")


async def models(request: web.Request) -> web.Response:
    async with request.app[SESSION].get(f"{request.app[FIRST_DECODE]}/v1/models") as response:
        return web.json_response(await response.json(), status=response.status)


def build_app(prefills: list[str], decodes: list[str]) -> web.Application:
    """The proxy's application over these P and D base URLs.

    Raises:
        ValueError: either list is empty.
    """
    if not prefills or not decodes:
        raise ValueError(f"the proxy needs at least one prefill and one decode server, got {prefills} and {decodes}")
    app = web.Application()
    app[PREFILLS] = itertools.cycle([p.rstrip("/") for p in prefills])
    app[DECODES] = itertools.cycle([d.rstrip("/") for d in decodes])
    app[FIRST_DECODE] = decodes[0].rstrip("/")

    async def session(app: web.Application) -> Any:
        app[SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True, help="base URL of a prefill server (repeat)")
    parser.add_argument("--decode", action="append", required=True, help="base URL of a decode server (repeat)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    web.run_app(build_app(args.prefill, args.decode), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
