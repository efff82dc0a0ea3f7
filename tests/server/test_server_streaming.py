from __future__ import annotations

from server.streaming import IncrementalDetokenizer, StopMatcher, TextStream


def byte_tokens(text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    return list(text.encode())


def token_bytes(token_id: int) -> bytes:
    return bytes([token_id])


def run_stream(text: str, stops: list[str]) -> tuple[list[str], str, bool]:
    stream = TextStream(token_bytes, stops)
    pieces = [stream.add(t) for t in byte_tokens(text)]
    tail = stream.finish()
    return pieces, "".join(pieces) + tail, stream.stopped


def test_multibyte_characters_are_emitted_whole():
    detok = IncrementalDetokenizer(token_bytes)
    pieces = [detok.add(t) for t in byte_tokens("né😀!")]
    assert pieces == ["n", "", "é", "", "", "", "😀", "!"]
    assert detok.flush() == ""


def test_truncated_character_at_the_end_becomes_replacement():
    detok = IncrementalDetokenizer(token_bytes)
    out = "".join(detok.add(t) for t in "a😀".encode()[:-1])
    assert out == "a"
    assert detok.flush() == "\ufffd"


def test_stop_string_spanning_tokens_is_not_emitted():
    pieces, text, stopped = run_stream("Hello, wörld. More text", ["ld."])
    assert stopped
    assert text == "Hello, wör"
    assert all("ld." not in p for p in pieces)


def test_multibyte_stop_string():
    _, text, stopped = run_stream("abc é😀 def", ["😀"])
    assert stopped and text == "abc é"


def test_held_back_text_is_released_when_no_stop_follows():
    pieces, text, stopped = run_stream("abab", ["abc"])
    assert not stopped
    assert text == "abab"
    assert pieces[1] == ""  # "ab" could start "abc": held back


def test_earliest_stop_wins():
    _, text, _ = run_stream("one two three", ["three", "two"])
    assert text == "one "


def test_partial_stop_at_the_end_is_flushed():
    matcher = StopMatcher(["END"])
    assert matcher.feed("xEN") == ("x", False)
    assert matcher.flush() == "EN"


def test_skipped_ids_emit_nothing():
    stream = TextStream(token_bytes, [], skip_ids=frozenset({ord("!")}))
    assert "".join(stream.add(t) for t in byte_tokens("hi!")) + stream.finish() == "hi"
