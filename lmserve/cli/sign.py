"""`lmserve sign PATH --key KEY`: sign a local model (a GGUF file or a repository directory) with a team's own key, in
the OpenSSF model-signing format (lmserve/store/signatures.py), so servers started with `--signature-key` (the public
half) and `--verify-signatures require` take it and refuse any copy that was changed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lmserve.cli.command import Command, Subparsers


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    sign = subparsers.add_parser(
        "sign", help="sign a local model (GGUF file or repository directory) with your key",
        description="Sign every file of a model: writes FILE.sig next to a GGUF file, or model.sig inside a "
        "repository directory. Verify with `lmserve serve --signature-key PUBLIC.pem --verify-signatures require`.")
    sign.add_argument("path", metavar="PATH", help="the model: a .gguf file or a repository directory")
    sign.add_argument("--key", required=True, metavar="PEM", help="the private key (elliptic curve, PEM)")
    sign.add_argument("--certificate", action="append", default=[], metavar="PEM",
                      help="sign with a certificate: the key's certificate first, then its chain (repeatable)")
    return sign


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Sign `args.path`; 0, or 1 with one `lmserve: …` line."""
    from lmserve.store.signatures import sign

    model, key = Path(args.path).expanduser(), Path(args.key).expanduser()
    for path, what in ((model, "model"), (key, "key"), *((Path(c), "certificate") for c in args.certificate)):
        if not path.exists():
            print(f"lmserve: {what} {path} not found", file=sys.stderr)
            return 1
    try:
        signature = sign(model, key, tuple(Path(path).expanduser() for path in args.certificate))
    except Exception as exc:  # model_signing's errors: a key it cannot read, a file it cannot hash
        print(f"lmserve: signing {model} failed: {exc}", file=sys.stderr)
        return 1
    print(f"signed {model}: {signature}")
    return 0


COMMAND = Command("sign", add_parser, run)
