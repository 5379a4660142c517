"""The API key: where it comes from (--api-key, --api-key-file, $LOWBIT_API_KEY) and its constant-time check.

Imports nothing heavy: the CLI resolves the key before the model loads.
"""
import hmac
import os
from pathlib import Path

from lowbit.errors import UserError

ENV_VAR = "LOWBIT_API_KEY"


def api_key_from(cli_key: str | None, key_file: Path | None, environ=os.environ) -> str | None:
    """The key to require, or None for an open server. One source only: --api-key or --api-key-file, else the
    environment variable (an empty one counts as unset). A file holds the key on its first line."""
    if cli_key is not None and key_file is not None:
        raise UserError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            lines = key_file.read_text().splitlines()
        except OSError as e:
            raise UserError(f"--api-key-file {key_file}: {e.strerror or e}") from e
        key = lines[0].strip() if lines else ""
        if not key:
            raise UserError(f"--api-key-file {key_file}: the file is empty (the key goes on its first line)")
        return key
    if cli_key is not None:
        if not cli_key:
            raise UserError("--api-key: the key is empty")
        return cli_key
    return environ.get(ENV_VAR) or None


def bearer_matches(authorization: str | None, key: str) -> bool:
    """`Authorization: Bearer KEY`, compared in constant time. Starlette decodes header bytes as latin-1, so
    encoding back to latin-1 gives the bytes the client sent; the key is compared as its UTF-8 bytes."""
    sent = (authorization or "").encode("latin-1", "replace")
    return hmac.compare_digest(sent, b"Bearer " + key.encode())
