"""Signed models: the OpenSSF model-signing format (the `model-signing` package), checked before a model enters the
store, so no engine ever reads weights whose signature does not hold; and `lmserve sign`, which signs a local model
with a team's own key.

A signature is a sigstore bundle over every file of a model: `model.sig` inside a repository directory, `FILE.sig`
next to a GGUF file. It is verified against what the operator trusts (`Trust`): an elliptic-curve public key
(`--signature-key`) or a certificate chain (`--signature-certificate`). Sigstore's keyless signatures (Fulcio and
Rekor) need the network and are not verified here.

`--verify-signatures` (or a Modelfile's `VERIFY`): `off` checks nothing; `warn` (the default) verifies a signature
that comes with a model and logs a failure or a signature it has no key for; `require` refuses a model without a
signature, with one that does not verify (a changed, added or missing file, another signer) or with no key to check
it, naming the file and why. A verified model's manifest keeps who signed it and when it was verified (`show`).
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lmserve.errors import InvalidRequest
from lmserve.types import VERIFY_MODES

log = logging.getLogger("lmserve")

MODES = VERIFY_MODES
DIRECTORY_SIGNATURE = "model.sig"
"""A repository directory's signature, inside it (left out of what it signs)."""
FILE_SUFFIX = ".sig"
"""A GGUF file's signature: the file's name and this, next to it."""


@dataclass(frozen=True, slots=True)
class Trust:
    """How models are checked: the mode (MODES) and what a signature must verify against."""

    mode: str = "warn"
    public_key: Path | None = None
    certificates: tuple[Path, ...] = ()

    def with_mode(self, mode: str | None) -> Trust:
        """This trust under a Modelfile's VERIFY (None: the server's mode)."""
        return self if mode is None else Trust(check_mode(mode), self.public_key, self.certificates)


def check_mode(mode: str, param: str = "verify") -> str:
    if mode not in MODES:
        raise InvalidRequest(f"signature verification {mode!r}: choose {', '.join(MODES)}", param=param)
    return mode


def signature_path(model: Path) -> Path:
    return model / DIRECTORY_SIGNATURE if model.is_dir() else model.with_name(model.name + FILE_SUFFIX)


def check(model: Path, trust: Trust) -> dict[str, str]:
    """Verify `model` (a GGUF file or a repository directory) as `trust` says, before anything reads it: the record
    for its manifest (signed_by, verified_at, signature; {} when nothing was verified), or InvalidRequest naming the
    model's file and why it is refused."""
    if trust.mode == "off":
        return {}
    signature = signature_path(model)
    if not signature.is_file():  # most models come without one: only `require` says anything
        if trust.mode == "require":
            _unverified(model, trust, f"it has no signature ({signature.name} next to it)")
        return {}
    if trust.public_key is None and not trust.certificates:
        return _unverified(model, trust, f"{signature.name} cannot be checked: no --signature-key or "
                                         "--signature-certificate to verify it with")
    try:
        _verifier(trust, model, signature).verify(model.resolve(), signature.resolve())
    except Exception as exc:  # model_signing's ValueError, a bundle that is not JSON, an unreadable key
        return _unverified(model, trust, f"its signature does not verify: {_reason(exc, model.name)}")
    verified = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    return {"signed_by": signer(signature, trust), "verified_at": verified, "signature": signature.name}


def _unverified(model: Path, trust: Trust, why: str) -> dict[str, str]:
    if trust.mode == "require":
        raise InvalidRequest(f"{model.name} is refused (--verify-signatures require): {why}", param="from")
    log.warning("%s: %s", model.name, why)
    return {}


def _verifier(trust: Trust, model: Path, signature: Path) -> Any:
    """model_signing's verifier of `model`'s `signature` against what `trust` holds."""
    from model_signing import verifying

    config = verifying.Config()  # type: ignore[no-untyped-call]
    if trust.public_key is not None:
        config = config.use_elliptic_key_verifier(public_key=trust.public_key)
    else:
        config = config.use_certificate_verifier(certificate_chain=trust.certificates)
    if model.is_dir():
        config = config.set_hashing_config(_hashing(signature))
    return config


def _hashing(signature: Path) -> Any:
    """model_signing's hashing of a directory, its own signature file left out."""
    from model_signing import hashing

    config = hashing.Config().set_ignored_paths(paths=[signature.resolve()])  # type: ignore[no-untyped-call]
    return config.set_allow_symlinks(True)  # a pulled repository's files link to the hub cache's blobs


def signed_files(signature: Path) -> list[str]:
    """The files (relative paths) a directory's signature covers, as its bundle lists them ([] when it lists none
    or cannot be read: the verification then says why)."""
    try:
        bundle = json.loads(signature.read_text(encoding="utf-8"))
        statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
        return [str(resource["name"]) for resource in statement["predicate"]["resources"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def signer(signature: Path, trust: Trust) -> str:
    """Who signed: the subject of the bundle's signing certificate, or the public key's SHA-256 fingerprint."""
    bundle = json.loads(signature.read_text(encoding="utf-8"))
    chain = bundle.get("verificationMaterial", {}).get("x509CertificateChain", {}).get("certificates", [])
    if chain:
        from cryptography import x509

        return x509.load_der_x509_certificate(base64.b64decode(chain[0]["rawBytes"])).subject.rfc4514_string()
    if trust.public_key is not None:
        from cryptography.hazmat.primitives import serialization

        key = serialization.load_pem_public_key(trust.public_key.read_bytes())
        der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        return f"key sha256:{hashlib.sha256(der).hexdigest()}"
    return "unknown"


def sign(model: Path, private_key: Path, certificates: tuple[Path, ...] = ()) -> Path:
    """Sign `model` (a GGUF file or a repository directory) with `private_key` (PEM, elliptic curve), or with a
    certificate for that key and its chain; the signature path (`signature_path`)."""
    from model_signing import signing

    signature = signature_path(model)
    config = signing.Config()  # type: ignore[no-untyped-call]
    if certificates:
        config = config.use_certificate_signer(private_key=private_key, signing_certificate=certificates[0],
                                               certificate_chain=certificates[1:])
    else:
        config = config.use_elliptic_key_signer(private_key=private_key)
    if model.is_dir():
        config = config.set_hashing_config(_hashing(signature))
    config.sign(model.resolve(), signature.resolve())
    return signature


def _reason(exc: Exception, name: str) -> str:
    """model_signing's reason, each file it names said plainly (its digests' reprs left out; a single-file model,
    which it calls '.', by its `name`)."""
    text = str(exc) or type(exc).__name__
    listed = text.removeprefix("Signature mismatch: ")
    if listed == text:
        return text
    try:
        found = ast.literal_eval(listed)
    except (ValueError, SyntaxError):
        return listed
    said = [(f"{name if match.group(1) == '.' else match.group(1)} changed since it was signed"
             if (match := CHANGED.match(item)) else str(item))
            for item in (found if isinstance(found, list) else [found])]
    return "; ".join(said)


CHANGED = re.compile(r"Hash mismatch for '(.*?)': Expected")
