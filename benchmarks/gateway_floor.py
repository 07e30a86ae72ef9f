"""The HTTP layer's own floor: uvicorn (httptools + uvloop) serving TLS 1.3 with a route that does nothing.

    python -m benchmarks.gateway_floor PORT CERTFILE KEYFILE

Started by `benchmarks.gateway` beside the real server and driven by the same clients with the same requests:
what it costs per request is what any Python ASGI gateway on this stack pays before it does any work (HTTP
parsing, TLS records, the event loop, Starlette's routing), so the gateway's figure can be read against it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from security.tls import TLSConfig, uvicorn_ssl_kwargs

ANSWER = {
    "id": "chatcmpl-floor",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


async def chat(request: Request) -> Response:
    await request.body()  # read, as the gateway does
    return JSONResponse(ANSWER)


def main() -> None:
    port, cert, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    ssl = uvicorn_ssl_kwargs(TLSConfig(certfile=Path(cert), keyfile=Path(key)))
    uvicorn.run(app, host="127.0.0.1", port=port, http="httptools", loop="uvloop", log_level="warning", **ssl)


if __name__ == "__main__":
    main()
