"""A TLS client over memory buffers, for tests that must choose when each handshake byte leaves (a ClientHello
sent before the server accepts, half a ClientHello and then silence)."""

from __future__ import annotations

import contextlib
import socket
import ssl


def client_hello(ctx: ssl.SSLContext, server_hostname: str = "localhost") -> bytes:
    """The bytes a client sends first: its ClientHello."""
    return BioClient(ctx, server_hostname).pending()


class BioClient:
    """One TLS client connection whose bytes the test moves over a blocking socket itself."""

    def __init__(self, ctx: ssl.SSLContext, server_hostname: str = "localhost") -> None:
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.incoming, self.outgoing, server_hostname=server_hostname)
        with contextlib.suppress(ssl.SSLWantReadError):
            self.tls.do_handshake()  # writes the ClientHello to `outgoing`, then wants the server's answer

    def pending(self) -> bytes:
        return self.outgoing.read()

    def finish_handshake(self, sock: socket.socket) -> None:
        """Send what is pending and go on until the handshake is complete (the ClientHello may be sent already)."""
        while True:
            sock.sendall(self.pending())
            try:
                self.tls.do_handshake()
                sock.sendall(self.pending())
                return
            except ssl.SSLWantReadError:
                self._receive(sock)

    def request(self, sock: socket.socket, raw: bytes) -> bytes:
        """Send one HTTP/1.1 request (Connection: close) and read the response until the server closes."""
        self.tls.write(raw)
        sock.sendall(self.pending())
        out = b""
        while True:
            try:
                chunk = self.tls.read(65536)
            except ssl.SSLWantReadError:
                if not self._receive(sock):
                    return out
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return out
            if not chunk:
                return out
            out += chunk

    def _receive(self, sock: socket.socket) -> bool:
        data = sock.recv(65536)
        if not data:
            self.incoming.write_eof()
            return False
        self.incoming.write(data)
        return True
