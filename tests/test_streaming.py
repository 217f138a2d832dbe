import pytest

from shared.text.streaming import TextStream


def stream_all(tok, text, stop):
    ids = tok.encode(text)
    s = TextStream(tok, stop)
    parts, stopped_at = [], None
    for i, t in enumerate(ids):
        step = s.push(t)
        parts.append(step.text)
        if step.stopped:
            stopped_at = i
            break
    parts.append(s.finish())
    return "".join(parts), s, stopped_at


@pytest.mark.parametrize("text,stop,expected", [
    ("Hello world, this is a test. END of story", ["END"], "Hello world, this is a test. "),
    ("a b c d e f", ["x y z"], "a b c d e f"),
    ("The answer is 42.\n\nQuestion: next", ["\n\nQuestion:", "\n\nQ:"], "The answer is 42."),
    ("emoji 😀🎉 then STOP here", ["STOP"], "emoji 😀🎉 then "),
    ("no stops at all 日本語", [], "no stops at all 日本語"),
])
def test_stop_strings_cut_the_text(smollm2, text, stop, expected):
    out, s, _ = stream_all(smollm2.tokenizer, text, stop)
    assert out == expected == s.text


def test_partial_stop_prefix_is_held_back_then_released(smollm2):
    tok = smollm2.tokenizer
    s = TextStream(tok, ["<END>"])
    shown = []
    for t in tok.encode("value <EN"):
        shown.append(s.push(t).text)
    assert "".join(shown) == "value "  # "<EN" might begin "<END>": held back
    assert s.finish() == "<EN"  # generation ended without completing it: released
