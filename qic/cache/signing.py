"""Ed25519 signatures of compile-cache entries: keys (make, load, parse), signing an entry's meta.json (which
holds every file's sha256), and checking a signature against the configured public keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

from qic.errors import ConfigError
from qic.fsutil import write_bytes_atomic
from qic.manifest import canonical

SIGNATURE = "signature.json"


def load_private_key(path: str | Path):
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    try:
        key = load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{path}: not a readable PEM private key ({e})",
                          "make one with `qic cache keygen KEYFILE`") from None
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path}: not an Ed25519 key", "make one with `qic cache keygen KEYFILE`")
    return key


def public_key_hex(private_key) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def parse_public_keys(values) -> list[str]:
    """Public keys as hex: each value is 64 hex digits, or a file holding them (one per line)."""
    keys = []
    for v in values or ():
        v = str(v).strip()
        text = Path(v).read_text() if Path(v).is_file() else v
        for line in text.split():
            try:
                if len(bytes.fromhex(line)) != 32:
                    raise ValueError
            except ValueError:
                raise ConfigError(f"public key {line[:20]!r} (from {v}) is not 64 hex digits (an Ed25519 key)",
                                  "pass the .pub file `qic cache keygen` wrote") from None
            keys.append(line.lower())
    return keys


def sign(meta: dict, private_key) -> dict:
    return {"algorithm": "ed25519", "public_key": public_key_hex(private_key),
            "signature": private_key.sign(canonical(meta)).hex()}


def signature_problem(d: Path, meta: dict, public_keys: list[str]) -> str | None:
    """None if the entry's signature over its meta verifies against one of `public_keys`."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    try:
        sig = json.loads((d / SIGNATURE).read_text())
    except FileNotFoundError:
        return "it is not signed"
    except (OSError, ValueError):
        return "its signature file is unreadable"
    if not isinstance(sig, dict) or sig.get("public_key") not in public_keys:
        return "it is not signed by a configured public key"
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(sig["public_key"])).verify(
            bytes.fromhex(sig["signature"]), canonical(meta))
    except (InvalidSignature, ValueError, KeyError, TypeError):
        return "its signature does not verify"
    return None


def keygen(path: Path) -> tuple[Path, str]:
    """An Ed25519 key pair: PATH (private, PEM, mode 0600) and PATH.pub (the public key as hex)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
    path = Path(path)
    if path.exists():
        raise ConfigError(f"{path}: already exists; not overwriting a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:   # O_EXCL: never over another key, even one made meanwhile
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    pub = public_key_hex(key)
    # Atomic: a crash leaves no .pub or a whole one, never a truncated key that users would publish.
    write_bytes_atomic(Path(f"{path}.pub"), (pub + "\n").encode())
    return Path(f"{path}.pub"), pub
