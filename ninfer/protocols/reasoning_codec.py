"""Reasoning that round-trips through the client: Responses ``encrypted_content`` and Anthropic thinking
``signature`` are an opaque, integrity-checked encoding of the raw reasoning.

Clients that keep no server-side state (Codex sends ``store: false`` with ``include:
["reasoning.encrypted_content"]``) replay reasoning only through this field, so it must round-trip the reasoning
text exactly, across server restarts. The encoding is NOT encryption and hides nothing: it is URL-safe base64 of a
version tag, a truncated SHA-256 of the text and the UTF-8 text itself. The digest rejects a damaged or foreign value
instead of feeding the model garbage; it does not authenticate the sender (a client may equally send the raw
``reasoning_text`` or visible thinking). Anthropic ``display: "omitted"`` returns empty thinking whose signature is
this encoding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

from ninfer.protocols.fields import malformed

INCLUDE_ENCRYPTED_REASONING = "reasoning.encrypted_content"
_TAG = b"ninfer-reasoning-v1\x00"
_DIGEST_BYTES = 16


def _digest(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()[:_DIGEST_BYTES]


def encode_reasoning(text: str) -> str:
    """The ``encrypted_content`` string of reasoning ``text``."""
    raw = text.encode("utf-8")
    return base64.urlsafe_b64encode(_TAG + _digest(raw) + raw).decode("ascii")


def decode_reasoning(value: str, param: str) -> str:
    """The reasoning text of an ``encrypted_content`` value this server produced; else a 400 naming ``param``."""
    try:
        blob = base64.urlsafe_b64decode(value.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        blob = b""
    head, digest, raw = blob[:len(_TAG)], blob[len(_TAG):len(_TAG) + _DIGEST_BYTES], blob[len(_TAG) + _DIGEST_BYTES:]
    if head != _TAG or _digest(raw) != digest:
        raise malformed(param, "not an encoded reasoning value produced by this server (or it was altered); replay "
                        "it exactly as it was returned, or send the visible reasoning text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise malformed(param, "the encoded reasoning is not valid UTF-8") from None
