"""IncrementalDetokenizer: equals tokenizer.decode, never emits half a character, finds stop strings."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_engine.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tests.model_factory import EOS_ID, MULTILINGUAL_TEXT, build_tokenizer

TOKENIZER = build_tokenizer()
VOCAB = len(TOKENIZER)
TEXTS = [
    "def main(argv):\n    return sorted(argv, key=len)\n",
    MULTILINGUAL_TEXT,
    "naïve café — 中文字符 and emoji 😀🚀 then ascii again",
    "👍🏽👍🏽 日本語のテキスト ∑∫√",
]


def _stream(detok: IncrementalDetokenizer, token_ids, chunk_sizes) -> list[str]:
    deltas, i = [], 0
    sizes = iter(chunk_sizes)
    while i < len(token_ids):
        size = max(1, next(sizes, 1))
        deltas.append(detok.append(token_ids[i : i + size]))
        i += size
    deltas.append(detok.flush())
    return deltas


def _encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _reference_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """The documented rule, computed on the whole text: the match that completes first wins."""
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not matches:
        return text, None
    _, start, stop = min(matches)
    return text[:start], stop


def test_tokenizer_really_splits_characters_across_tokens():
    # Guards the premise of the multi-byte tests: some single tokens decode to U+FFFD alone.
    pieces = [TOKENIZER.decode([t]) for t in _encode(MULTILINGUAL_TEXT)]
    assert any(REPLACEMENT_CHAR in piece for piece in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_text_is_exact_and_never_shows_half_a_character(text):
    token_ids = _encode(text)
    detok = IncrementalDetokenizer(TOKENIZER, _encode("prompt: "))
    shown = ""
    for token_id in token_ids:
        delta = detok.append([token_id])
        assert REPLACEMENT_CHAR not in delta
        shown += delta
        assert text.startswith(shown)
    shown += detok.flush()
    assert shown == text == detok.text


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    output=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    chunks=st.lists(st.integers(1, 5), max_size=40),
    skip_special_tokens=st.booleans(),
)
def test_random_token_sequences_match_decode(prompt, output, chunks, skip_special_tokens):
    # Random ids include lone UTF-8 continuation bytes, half characters and special tokens.
    detok = IncrementalDetokenizer(TOKENIZER, prompt, skip_special_tokens=skip_special_tokens)
    deltas = _stream(detok, output, chunks)
    expected = TOKENIZER.decode(output, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert detok.text == expected
    assert not detok.stopped


def test_special_tokens_skipped_or_kept():
    token_ids = [*_encode("hello"), EOS_ID]
    skipped = IncrementalDetokenizer(TOKENIZER, [1], skip_special_tokens=True)
    assert skipped.append(token_ids) + skipped.flush() == "hello"
    kept = IncrementalDetokenizer(TOKENIZER, [1], skip_special_tokens=False)
    assert kept.append(token_ids) + kept.flush() == "hello<|eos|>"


def test_incomplete_character_at_the_end_is_released_by_flush():
    token_ids = _encode("ab中")
    # Find a cut that leaves the last character incomplete.
    cut = next(
        n for n in range(1, len(token_ids)) if TOKENIZER.decode(token_ids[:n]).endswith(REPLACEMENT_CHAR)
    )
    detok = IncrementalDetokenizer(TOKENIZER, [])
    shown = detok.append(token_ids[:cut])
    assert REPLACEMENT_CHAR not in shown
    released = detok.flush()
    assert released.endswith(REPLACEMENT_CHAR)
    assert shown + released == detok.text == TOKENIZER.decode(token_ids[:cut])


def test_finished_append_flushes():
    token_ids = _encode("the end")
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=("XYZ",))
    # The stop string's length-1 hold-back is released on the request's last tokens.
    assert detok.append(token_ids[:-1]) + detok.append(token_ids[-1:], finished=True) == "the end"
    with pytest.raises(RuntimeError, match="after flush"):
        detok.append(_encode("more"))
    assert detok.flush() == ""


# -- stop strings -------------------------------------------------------------------------------------


def test_stop_string_spanning_token_boundaries():
    text = "value = compute(alpha, beta) # STOP_HERE then more text"
    stop = "STOP_HERE"
    token_ids = _encode(text)
    starts = [len(TOKENIZER.decode(token_ids[:n])) for n in range(len(token_ids) + 1)]
    begin = text.index(stop)
    # The premise: some token boundary falls strictly inside the stop string.
    assert any(begin < s < begin + len(stop) for s in starts)

    detok = IncrementalDetokenizer(TOKENIZER, [], stop=(stop,))
    shown = ""
    for token_id in token_ids:
        shown += detok.append([token_id])
        assert stop[:2] not in shown  # the held-back tail never leaks the stop string's start
        if detok.stopped:
            break
    assert detok.stopped and detok.stop_reason == stop
    assert shown == detok.text == text[:begin]
    assert detok.append(_encode(" ignored")) == ""  # a late token after the stop changes nothing
    assert detok.flush() == ""


def test_multibyte_stop_string_split_inside_characters():
    text = "abc 中文字符 def"
    token_ids = _encode(text)
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=("文字",))
    shown = "".join(detok.append([t]) for t in token_ids)
    assert detok.stop_reason == "文字"
    assert shown == detok.text == "abc 中"


def test_stop_in_the_very_first_token():
    first = _encode("return x")[0]
    first_text = TOKENIZER.decode([first])
    detok = IncrementalDetokenizer(TOKENIZER, _encode("prompt"), stop=(first_text,))
    assert detok.append([first]) == ""
    assert detok.stopped and detok.stop_reason == first_text and detok.text == ""


def test_earliest_of_several_stop_strings_wins():
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=("ghi", "def", "zzz"))
    assert detok.append(_encode("abc def ghi")) == "abc "
    assert detok.stop_reason == "def"


def test_stop_that_completes_first_wins_over_one_that_starts_first():
    # "yz" is complete before "xyz123" is; streamed character by character it would stop first.
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=("xyz123", "yz"))
    assert detok.append(_encode("wxyz123")) == "wx"
    assert detok.stop_reason == "yz"


def test_stop_strings_count_only_from_min_tokens_on():
    tokens = _encode("abc def ghi def")
    n_before_second = len(_encode("abc def ghi "))
    # The first "def" ends before min_tokens tokens exist: ignored; the second one stops.
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=("def",), min_tokens=n_before_second)
    for token in tokens:
        detok.append([token])
    assert detok.stopped and detok.text == "abc def ghi "
    # Without min_tokens the first one stops.
    eager = IncrementalDetokenizer(TOKENIZER, [], stop=("def",))
    eager.append(tokens)
    assert eager.text == "abc "


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(TOKENIZER, [], stop=("",))


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab中😀 \n", min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet="ab中😀 \n", min_size=1, max_size=4), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_stop_result_does_not_depend_on_chunking(text, stops, seed):
    stops = tuple(stops)
    token_ids = _encode(text)
    expected_text, expected_stop = _reference_stop(text, stops)
    rng = random.Random(seed)
    for chunks in ([1] * len(token_ids), [len(token_ids)], [rng.randint(1, 4) for _ in token_ids]):
        detok = IncrementalDetokenizer(TOKENIZER, [], stop=stops)
        shown = "".join(_stream(detok, token_ids, chunks))
        assert (shown, detok.stop_reason) == (expected_text, expected_stop)
        assert detok.text == expected_text


def test_prompt_ending_mid_character_is_not_merged_into_the_output():
    # Raw token-id prompts can end halfway through a character; the output's first bytes then
    # decode on their own (as U+FFFD), exactly as tokenizer.decode(output) does.
    token_ids = _encode("x中文")
    cut = next(
        n for n in range(1, len(token_ids)) if TOKENIZER.decode(token_ids[:n]).endswith(REPLACEMENT_CHAR)
    )
    prompt, output = token_ids[:cut], token_ids[cut:] + _encode(" ok")
    detok = IncrementalDetokenizer(TOKENIZER, prompt)
    shown = "".join(detok.append([t]) for t in output) + detok.flush()
    assert shown == TOKENIZER.decode(output)
    assert shown.startswith(REPLACEMENT_CHAR)


def test_the_rust_decoder_is_used_only_where_it_equals_transformers_decode():
    import copy

    from compiled_engine.engine.detokenizer import backend_decoder

    # The tests above therefore check the fast path against transformers' own decode.
    assert backend_decoder(TOKENIZER) is not None
    cleaning = copy.deepcopy(TOKENIZER)
    cleaning.clean_up_tokenization_spaces = True  # transformers may then rewrite the text
    assert backend_decoder(cleaning) is None
    assert backend_decoder(object()) is None
