from __future__ import annotations

import asyncio
import functools
import ssl
from typing import Any, Literal

from cryptography import x509
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string
from uvicorn.protocols.http.h11_impl import H11Protocol


def tls_info(ssl_object: ssl.SSLObject) -> dict[str, str | None]:
    """What the app may know about a TLS connection: version, cipher, verified client subject (RFC 4514)."""
    der = ssl_object.getpeercert(binary_form=True)
    cipher = ssl_object.cipher()
    return {
        "version": ssl_object.version(),
        "cipher": cipher[0] if cipher else None,
        "client_subject": x509.load_der_x509_certificate(der).subject.rfc4514_string() if der else None,
    }


class TLSScope:
    """ASGI wrapper putting one connection's `tls_info` at `scope["extensions"]["tls"]`."""

    def __init__(self, app: ASGIApp, tls: dict[str, str | None]) -> None:
        self.app = app
        self.tls = tls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("extensions", {})["tls"] = dict(self.tls)
        await self.app(scope, receive, send)


def _with_tls(base: type[Any]) -> type[asyncio.Protocol]:
    # uvicorn builds one protocol per connection and reads `self.app` per request, so wrapping
    # the app at connection_made tags every request on this connection, h11 or httptools alike.
    def connection_made(self: Any, transport: asyncio.Transport) -> None:
        base.connection_made(self, transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self.app = TLSScope(self.app, tls_info(ssl_object))

    name = f"TLS{base.__name__}"
    return type(name, (base,), {"connection_made": connection_made, "__module__": __name__, "__qualname__": name})


TLSH11Protocol = _with_tls(H11Protocol)


@functools.cache
def http_protocol_class(http: Literal["auto", "h11", "httptools"] = "auto") -> type[asyncio.Protocol]:
    """The class to pass as `uvicorn.Config(http=...)`; "auto" picks httptools when installed, as uvicorn does."""
    base = import_from_string(HTTP_PROTOCOLS[http])
    return TLSH11Protocol if base is H11Protocol else _with_tls(base)
