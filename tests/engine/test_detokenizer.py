"""TextStream with the embedded model's real tokenizer: UTF-8 safety and stop strings."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import TextStream


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from engine.models.loader import default_model_dir
    from engine.settings import Settings

    return AutoTokenizer.from_pretrained(default_model_dir(Settings.from_env().cache_dir))


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def run_stream(tok, ids, stop=None):
    """Feed ids one at a time, as the engine does (it stops feeding once the stream stopped)."""
    stream = TextStream(tok, stop)
    deltas = []
    stopped_at = None
    for i, t in enumerate(ids):
        deltas.append(stream.add(t))
        if stream.stopped:
            stopped_at = i
            break
    deltas.append(stream.finish())
    return stream, deltas, stopped_at


MULTIBYTE_TEXTS = [
    "héllo wörld, café crème brûlée, naïve résumé, Ångström, Øresund, Łódź",
    "你好，世界！这是一个测试。日本語のテキストも。한국어 문장입니다.",
    "Party 🎉🎉 time 🍕 now 👨‍👩‍👧 family 🇫🇷 flag 👍🏽 ok",
    "Mixed: e\u0301 (combining), ß, Ω≈ç√∫, ∑∆, «quotes» — dash… ellipsis",
    "🦀🦀🦀🦀🦀🦀🦀🦀",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",  # Devanagari
]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_token_by_token_never_emits_replacement_char(tok, text):
    ids = tok(text).input_ids
    # Precondition: some character really is split across tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()
    stream, deltas, stopped_at = run_stream(tok, ids)
    assert stopped_at is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == decode(tok, ids)
    assert stream.text == decode(tok, ids)


def test_every_prefix_emits_only_complete_characters(tok):
    text = "Émoji 🎉 and 漢字 mixed"
    ids = tok(text).input_ids
    stream = TextStream(tok)
    out = ""
    for i, t in enumerate(ids):
        out += stream.add(t)
        assert "\ufffd" not in out
        assert decode(tok, ids[:i + 1]).startswith(out)
    out += stream.finish()
    assert out == decode(tok, ids)


def test_special_tokens_are_skipped_mid_stream(tok):
    a, b = tok("Hello").input_ids, tok(" wörld 🎉").input_ids
    specials = [tok.eos_token_id] + [x for x in tok.all_special_ids if x != tok.eos_token_id][:1]
    ids = a + specials + b + specials
    _, deltas, _ = run_stream(tok, ids)
    assert "".join(deltas) == decode(tok, ids) == "Hello wörld 🎉"


def test_finish_flushes_an_incomplete_tail(tok):
    ids = tok("ok 🎉").input_ids
    partial = ids[:-1]  # the emoji cut in the middle
    assert decode(tok, partial).endswith("\ufffd")
    stream = TextStream(tok)
    emitted = "".join(stream.add(t) for t in partial)
    assert "\ufffd" not in emitted
    assert emitted + stream.finish() == decode(tok, partial)


_ALPHABET = st.sampled_from(list("abc XYZ.,\n!?0123") + list("éüñçøßΩж你好世界日本語🎉🍕👍🏽🦀—…"))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(_ALPHABET, min_size=1, max_size=40))
def test_random_text_deltas_concatenate_to_decode(tok, text):
    ids = tok(text).input_ids
    _, deltas, _ = run_stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == decode(tok, ids)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=20))
def test_arbitrary_token_ids_concatenate_to_decode(tok, ids):
    """Even ids that do not form valid UTF-8 (what a sampled model may produce) lose or add nothing."""
    _, deltas, _ = run_stream(tok, ids)
    assert "".join(deltas) == decode(tok, ids)


# ---- stop strings ----------------------------------------------------------------------------------


def check_stop(tok, text, stop):
    """Runs a stream whose output contains `stop`; checks cut, timing and that nothing past the cut leaks."""
    stops = stop if isinstance(stop, list) else [stop]
    ids = tok(text).input_ids
    full = decode(tok, ids)
    cut = min(i for i in (full.find(s) for s in stops) if i >= 0)
    expected = full[:cut]
    # The token that completes the first stop string: the first prefix whose text decodes cleanly (no
    # trailing half character, which the stream holds back) and contains a stop string.
    complete_at = next(i for i in range(len(ids)) if not decode(tok, ids[:i + 1]).endswith("\ufffd")
                       and any(s in decode(tok, ids[:i + 1]) for s in stops))
    stream = TextStream(tok, stops)
    out = ""
    for i, t in enumerate(ids):
        out += stream.add(t)
        assert expected.startswith(out), (i, out)  # never a byte of the stop string or beyond
        assert "\ufffd" not in out
        if stream.stopped:
            break
    assert stream.stopped
    assert i == complete_at
    out += stream.finish()
    assert out == expected
    assert stream.text == expected
    return ids


@pytest.mark.parametrize("text, stop", [
    ("The answer is 42.\nEND of story", "\nEND"),
    ("The answer is 42.\nEND of story", "42."),
    ("I like cheese and crackers.", "cheese and"),
    ("I like cheese and crackers.", "ike chee"),
    ("你好，世界！这是一个测试。", "世界"),
    ("Party 🎉🎉 time 🍕 now", "🍕"),
    ("Party 🎉🎉 time 🍕 now", "🎉 t"),
    ("Stop right here", "Stop r"),  # at the very start: nothing is emitted
    ("count to ten: one two three", "two three"),  # completed by the last token
])
def test_stop_string_split_across_tokens(tok, text, stop):
    ids = tok(text).input_ids
    pieces = [tok.decode([i]) for i in ids]
    # Precondition: no single token spells the whole stop string (it is split).
    assert not any(stop in p for p in pieces)
    check_stop(tok, text, stop)


def test_stop_string_in_one_token(tok):
    ids = check_stop(tok, "I like cheese and crackers.", "cheese")
    assert " cheese" in [tok.decode([i]) for i in ids]


def test_earliest_of_several_stop_strings_wins(tok):
    check_stop(tok, "alpha beta gamma delta epsilon", ["delta", "beta gam", "zeta"])


def test_long_and_short_stops_together(tok):
    check_stop(tok, "xx ab yy some very long stop marker", ["some very long stop marker", "yy"])


def test_partial_stop_that_does_not_complete_is_released(tok):
    text = "I said STO and STOP it"  # "STO" looks like the start of "STOP!" but is not
    ids = tok(text).input_ids
    stream, deltas, stopped_at = run_stream(tok, ids, ["STOP!", "zzz"])
    assert stopped_at is None and not stream.stopped
    assert "".join(deltas) == decode(tok, ids) == text


def test_held_back_text_only_covers_a_possible_stop_prefix(tok):
    stop = "<END>"
    ids = tok("one two three four five six").input_ids
    stream = TextStream(tok, [stop])
    out = ""
    for t in ids:
        out += stream.add(t)
        # Everything except at most len(stop) - 1 characters is already out.
        assert len(stream.text) - len(out) <= len(stop) - 1
    assert out + stream.finish() == decode(tok, ids)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(_ALPHABET, min_size=2, max_size=40), data=st.data())
def test_random_stop_strings(tok, text, data):
    full = decode(tok, tok(text).input_ids)
    start = data.draw(st.integers(0, len(full) - 1))
    length = data.draw(st.integers(1, min(6, len(full) - start)))
    stop = full[start:start + length]
    if "\ufffd" in stop:  # a character the tokenizer could not represent: not a meaningful stop
        return
    check_stop(tok, text, stop)
