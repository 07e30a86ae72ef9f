"""A KEK on a PKCS#11 token (an HSM; SoftHSM2 in tests): a sensitive, non-extractable AES key.

SM4 runs in software (SoftHSM and most HSMs reached through standard mechanisms have no SM4), so
the token unwraps the data key with CKM_AES_KEY_WRAP into a session object whose value we read.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pkcs11
from pkcs11 import Attribute, KeyType, Mechanism, ObjectClass
from pkcs11 import exceptions as p11

from security.keys import KeyProviderError, read_secret_file

SPEC_KEYS = ("module", "token", "key", "pin-file", "pin-env")
_DEK_TEMPLATE = {Attribute.TOKEN: False, Attribute.SENSITIVE: False, Attribute.EXTRACTABLE: True}


class Pkcs11KeyProvider:
    """Wraps data keys under the AES key labelled `key` on token `token`; checks token, PIN and key up front."""

    kind = "pkcs11"

    def __init__(self, module: str, token: str, key: str, pin: str) -> None:
        self.module = module
        self.token_label = token
        self.key_label = key
        self.key_id = f"pkcs11:{key}"
        self._pin = pin
        self._lock = threading.Lock()
        self._pid = os.getpid()
        try:
            self._lib = pkcs11.lib(module)
        except (OSError, RuntimeError) as e:  # python-pkcs11 raises a bare RuntimeError for a bad module
            raise KeyProviderError(f"cannot load PKCS#11 module {module}: {e}") from None
        with self._session() as kek:
            if kek[Attribute.EXTRACTABLE] or not kek[Attribute.SENSITIVE]:
                raise KeyProviderError(
                    f"key {key!r} on token {token!r} must be sensitive and non-extractable to serve as a KEK"
                )
            if not (kek[Attribute.WRAP] and kek[Attribute.UNWRAP]):
                raise KeyProviderError(f"key {key!r} on token {token!r} lacks CKA_WRAP/CKA_UNWRAP")

    @classmethod
    def from_spec(cls, spec: str, environ: Mapping[str, str]) -> Pkcs11KeyProvider:
        """`module=PATH;token=LABEL;key=LABEL;pin-file=PATH` (or `pin-env=VARIABLE`)."""
        fields: dict[str, str] = {}
        for part in filter(None, spec.split(";")):
            name, sep, value = part.partition("=")
            if not sep or name not in SPEC_KEYS or name in fields:
                raise KeyProviderError(f"bad pkcs11 key provider field {name!r}: use {', '.join(SPEC_KEYS)}, once each")
            fields[name] = value
        missing = [k for k in ("module", "token", "key") if not fields.get(k)]
        if missing or ("pin-file" in fields) == ("pin-env" in fields):
            need = ", ".join(missing) or "exactly one of pin-file, pin-env"
            raise KeyProviderError(f"the pkcs11 key provider needs {need}")
        if "pin-file" in fields:
            pin_bytes = read_secret_file(Path(fields["pin-file"]), "PIN file")
            pin = pin_bytes.decode("utf-8", "replace").strip()
        else:
            pin = environ.get(fields["pin-env"], "")
        if not pin:
            raise KeyProviderError(f"the PIN for token {fields['token']!r} is empty")
        return cls(fields["module"], fields["token"], fields["key"], pin)

    def wrap(self, dek: bytes) -> bytes:
        with self._session() as kek:
            template = {Attribute.CLASS: ObjectClass.SECRET_KEY, Attribute.KEY_TYPE: KeyType.AES, Attribute.VALUE: dek}
            obj = kek.session.create_object({**template, **_DEK_TEMPLATE})
            try:
                return bytes(kek.wrap_key(obj, mechanism=Mechanism.AES_KEY_WRAP))
            except p11.PKCS11Error as e:
                raise KeyProviderError(f"the HSM cannot wrap with {self.key_id}: {_name(e)}") from None

    def unwrap(self, blob: bytes) -> bytes:
        with self._session() as kek:
            try:
                dek = kek.unwrap_key(
                    ObjectClass.SECRET_KEY,
                    KeyType.AES,
                    blob,
                    mechanism=Mechanism.AES_KEY_WRAP,
                    store=False,
                    template=_DEK_TEMPLATE,
                )
                return bytes(dek[Attribute.VALUE])
            except p11.PKCS11Error as e:
                raise KeyProviderError(
                    f"the data key does not unwrap under {self.key_id} on token {self.token_label!r} "
                    f"(wrong key, or edited): {_name(e)}"
                ) from None

    @contextmanager
    def _session(self) -> Iterator[Any]:
        where = f"token {self.token_label!r} ({self.module})"
        with self._lock:
            if os.getpid() != self._pid:  # PKCS#11: a forked child must initialise the library again
                self._lib.reinitialize()
                self._pid = os.getpid()
            try:
                token = self._lib.get_token(token_label=self.token_label)
                session = token.open(user_pin=self._pin)
            except p11.NoSuchToken:
                raise KeyProviderError(f"no {where}") from None
            except (p11.PinIncorrect, p11.PinInvalid, p11.PinLenRange):
                raise KeyProviderError(f"the PIN for {where} is wrong") from None
            except p11.PinLocked:
                raise KeyProviderError(f"the PIN for {where} is locked") from None
            except p11.PKCS11Error as e:
                raise KeyProviderError(f"cannot log in to {where}: {_name(e)}") from None
            try:
                try:
                    kek = session.get_key(
                        object_class=ObjectClass.SECRET_KEY, key_type=KeyType.AES, label=self.key_label
                    )
                except p11.NoSuchKey:
                    raise KeyProviderError(f"no AES key labelled {self.key_label!r} on {where}") from None
                except p11.MultipleObjectsReturned:
                    raise KeyProviderError(f"more than one AES key labelled {self.key_label!r} on {where}") from None
                yield kek
            finally:
                session.close()

    def __repr__(self) -> str:
        return f"Pkcs11KeyProvider(module={self.module!r}, token={self.token_label!r}, key={self.key_label!r})"


def _name(e: Exception) -> str:
    return type(e).__name__ + (f": {e}" if str(e) else "")
