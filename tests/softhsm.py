"""A SoftHSM2 token in a temporary directory, for tests of the pkcs11 key provider.

SoftHSM reads SOFTHSM2_CONF when the module is initialised in this process, so the helper sets it
for its lifetime and re-initialises a module python-pkcs11 already loaded. Skips when SoftHSM2 is
absent (`apt-get install softhsm2`; .ci/run installs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

MODULES = ("/usr/lib/softhsm/libsofthsm2.so", "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so")
KEK_TEMPLATE = {
    "SENSITIVE": True,
    "EXTRACTABLE": False,
    "WRAP": True,
    "UNWRAP": True,
    "ENCRYPT": False,
    "DECRYPT": False,
}


@dataclass(frozen=True, slots=True)
class SoftHsm:
    module: str
    token: str
    pin: str
    so_pin: str
    root: Path

    def pin_file(self, pin: str | None = None) -> Path:
        path = self.root / f"pin-{os.urandom(4).hex()}"
        path.write_text((pin or self.pin) + "\n")
        path.chmod(0o600)
        return path

    def spec(self, key: str, pin: str | None = None, token: str | None = None) -> str:
        return f"pkcs11:module={self.module};token={token or self.token};key={key};pin-file={self.pin_file(pin)}"

    def generate_kek(self, label: str, **attrs: bool) -> None:
        """An AES-256 key generated on the token; non-extractable and sensitive unless `attrs` says otherwise."""
        import pkcs11
        from pkcs11 import Attribute, KeyType

        template = {Attribute[k]: v for k, v in {**KEK_TEMPLATE, **attrs}.items()}
        with pkcs11.lib(self.module).get_token(token_label=self.token).open(rw=True, user_pin=self.pin) as s:
            s.generate_key(KeyType.AES, 256, label=label, store=True, template=template)

    def import_kek(self, label: str, value: bytes) -> None:
        """A known AES key, made sensitive and non-extractable as it lands on the token (to compare with software)."""
        import pkcs11
        from pkcs11 import Attribute, KeyType, ObjectClass

        attrs = {Attribute[k]: v for k, v in KEK_TEMPLATE.items()}
        template = {Attribute.CLASS: ObjectClass.SECRET_KEY, Attribute.KEY_TYPE: KeyType.AES, Attribute.VALUE: value}
        with pkcs11.lib(self.module).get_token(token_label=self.token).open(rw=True, user_pin=self.pin) as s:
            s.create_object({**template, **attrs, Attribute.TOKEN: True, Attribute.LABEL: label})


def softhsm_module() -> str | None:
    if shutil.which("softhsm2-util") is None:
        return None
    return next((m for m in MODULES if Path(m).exists()), None)


@contextmanager
def softhsm_token(
    root: Path, token: str = "tianmen-test", pin: str = "123456", so_pin: str = "87654321"
) -> Iterator[SoftHsm]:
    module = softhsm_module()
    if module is None:
        if os.environ.get("CI"):  # .ci/run installs it: in CI its absence is a failure, not a skip
            pytest.fail("SoftHSM2 is not installed (apt-get install softhsm2)")
        pytest.skip("SoftHSM2 is not installed (apt-get install softhsm2)")
    (root / "tokens").mkdir(parents=True)
    conf = root / "softhsm2.conf"
    conf.write_text(f"directories.tokendir = {root / 'tokens'}\nobjectstore.backend = file\nlog.level = ERROR\n")
    env = {**os.environ, "SOFTHSM2_CONF": str(conf)}
    cmd = ["softhsm2-util", "--init-token", "--free", "--label", token, "--so-pin", so_pin, "--pin", pin]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOFTHSM2_CONF", str(conf))
        import pkcs11

        if module in pkcs11._loaded:  # initialised under another test's config: read ours
            pkcs11._loaded[module].reinitialize()
        yield SoftHsm(module, token, pin, so_pin, root)
