"""A matcher's packed mask is exactly llguidance's allowed set (each token checked on its own),
EOS is allowed exactly when the grammar can end, special tokens never otherwise; it advances
through many tokens at once, refuses a token the grammar does not allow without consuming any,
rolls back, and its integrity check catches a count that drifted."""

import numpy as np
import pytest

from pddjax.grammar.matcher import GrammarRejected, fill_masks
from pddjax.grammar.spec import GrammarSpec
from pddjax.model.token_mask import allowed_np
from tests.grammar.tiny_vocab import EOS, VOCAB, compiler, grammar_tokenizer

SCHEMA = GrammarSpec.json_schema({"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                                                   "n": {"type": "integer"}},
                                  "required": ["name", "n"], "additionalProperties": False})


def allowed_one_by_one(m) -> set[int]:
    return {t for t in range(VOCAB) if m.allows(t)}


def mask_set(m) -> set[int]:
    return set(np.flatnonzero(allowed_np(m.mask(), VOCAB)).tolist())


@pytest.mark.parametrize("spec, text", [(SCHEMA, '{"name": "ab", "n": 12}'), (GrammarSpec.regex("[a-c]+x?"), "abcx"),
                                        (GrammarSpec.lark('start: "hi" /[0-9]+/'), "hi42")])
def test_the_mask_is_llguidances_allowed_set_at_every_position(spec, text):
    m = compiler().matcher(spec)
    ids = grammar_tokenizer().encode(text)
    for t in ids:
        got = mask_set(m)
        assert got == allowed_one_by_one(m) and t in got
        assert (EOS in got) == m.is_accepting()
        assert not {0, 1} & got  # the other special tokens: never
        m.advance([t])
        m.check_integrity()
    assert m.is_accepting() and EOS in mask_set(m)


def test_eos_exactly_when_the_grammar_can_end():
    m = compiler().matcher(GrammarSpec.regex("a+"))
    a = grammar_tokenizer().encode("a")[0]
    assert EOS not in mask_set(m) and not m.is_accepting()
    m.advance([a])
    assert EOS in mask_set(m) and a in mask_set(m) and not m.is_finished()
    m.advance([EOS])
    assert m.is_finished()
    done = compiler().matcher(GrammarSpec.regex("ab"))
    done.advance(grammar_tokenizer().encode("ab"))
    assert done.is_finished() and mask_set(done) == {EOS}


def test_a_refused_token_raises_and_consumes_nothing():
    m = compiler().matcher(SCHEMA)
    good = grammar_tokenizer().encode('{"name": "')
    m.advance(good)
    more = good + grammar_tokenizer().encode("x}")  # inside the string: allowed
    with pytest.raises(GrammarRejected, match=r"token \d+ at output position 0 is not allowed by the request's "
                                              r"json_schema grammar"):
        compiler().matcher(SCHEMA).advance(grammar_tokenizer().encode("[1]"))
    with pytest.raises(GrammarRejected, match=f"at output position {len(good)} "):
        m.advance([EOS])
    assert m.consumed == len(good)
    m.check_integrity(len(good))
    m.advance(more[len(good):])
    assert m.consumed == len(more)


def test_advance_many_at_once_equals_one_by_one_and_rollback_returns():
    ids = grammar_tokenizer().encode('{"name": "abcd", "n": 7}')
    many, one = compiler().matcher(SCHEMA), compiler().matcher(SCHEMA)
    many.advance(ids)
    for t in ids:
        one.advance([t])
    assert (many.mask() == one.mask()).all() and many.consumed == len(ids) and many.is_finished()
    many.rollback(5)
    fresh = compiler().matcher(SCHEMA)
    fresh.advance(ids[:-5])
    assert (many.mask() == fresh.mask()).all() and not many.is_finished()
    with pytest.raises(ValueError, match="cannot roll back"):
        many.rollback(len(ids))


def test_check_integrity_catches_a_count_that_drifted():
    m = compiler().matcher(SCHEMA)
    m.advance(grammar_tokenizer().encode("{"))
    with pytest.raises(AssertionError, match="consumed 1 tokens, the sequence has 2"):
        m.check_integrity(2)


def test_fill_masks_fills_named_rows_at_once_and_leaves_the_rest():
    specs = [SCHEMA, GrammarSpec.regex("[0-9]{3}"), GrammarSpec.lark('start: "yes" | "no"')]
    ms = [compiler().matcher(s) for s in specs]
    out = np.full((5, grammar_tokenizer().words), -1, np.int32)
    fill_masks([(ms[0], 0), (ms[1], 2), (ms[2], 4)], out)
    for m, r in zip(ms, (0, 2, 4)):
        assert (out[r] == m.mask()).all()
    assert (out[[1, 3]] == -1).all()
    with pytest.raises(ValueError, match="a mask row must be a writable C-contiguous int32"):
        ms[0].fill_mask(np.zeros(3, np.int32))


def test_tokens_that_are_not_valid_utf8_alone_build_a_character():
    """'é' is two bytes (c3 a9): in the tiny vocabulary, two byte tokens, neither UTF-8 alone."""
    tok = grammar_tokenizer()
    ids = tok.encode("é")
    assert len(ids) == 2 and tok.token_bytes(ids[:1]) == b"\xc3"
    m = compiler().matcher(GrammarSpec.regex("é+"))
    assert ids[0] in mask_set(m) and ids[1] not in mask_set(m)
    m.advance(ids)
    assert m.is_accepting()
