from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import uvicorn


@dataclass(slots=True, frozen=True)
class TLSConfig:
    certfile: Path
    keyfile: Path
    client_ca: Path | None = None  # set: mTLS, a client certificate signed by this CA is required
    min_version: ssl.TLSVersion = field(default=ssl.TLSVersion.TLSv1_3, init=False)

    def __post_init__(self) -> None:
        for name in ("certfile", "keyfile", "client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLSConfig.{name}: no such file {path}")


def tls13_context_factory(config: uvicorn.Config, default_factory: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
    """uvicorn `ssl_context_factory`: uvicorn's own context, with TLS 1.3 as the floor."""
    ctx = default_factory()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def uvicorn_ssl_kwargs(cfg: TLSConfig) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.Config(...)` that serve TLS 1.3 only, and mTLS when `client_ca` is set."""
    assert cfg.min_version is ssl.TLSVersion.TLSv1_3
    kwargs: dict[str, Any] = {
        "ssl_certfile": str(cfg.certfile),
        "ssl_keyfile": str(cfg.keyfile),
        # module-level function, not a closure: uvicorn pickles its Config for workers > 1
        "ssl_context_factory": tls13_context_factory,
    }
    if cfg.client_ca is not None:
        kwargs |= {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(cfg.client_ca)}
    return kwargs


def client_ssl_context(cafile: Path, certfile: Path | None = None, keyfile: Path | None = None) -> ssl.SSLContext:
    """A TLS 1.3 client context trusting `cafile`, presenting a client certificate when given."""
    ctx = ssl.create_default_context(cafile=str(cafile))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if certfile is not None:
        ctx.load_cert_chain(str(certfile), None if keyfile is None else str(keyfile))
    return ctx
