"""The step's mask (jnp) and its numpy twin agree with llguidance's own numpy applier: disallowed
tokens -inf, allowed ones untouched, an all-ones row changes nothing; inside the jitted sampler
the mask decides greedy and sampled rows alike."""

import jax
import jax.numpy as jnp
import numpy as np
from llguidance.numpy import apply_token_bitmask_inplace

from pddjax.engines.step import neutral_sampling
from pddjax.model import token_mask
from pddjax.model.sampling import sample_step

V = 77  # not a multiple of 32: the last word's high bits are past the vocabulary


def random_mask(B, seed=0):
    bits = np.random.default_rng(seed).random((B, 32 * token_mask.words(V))) < 0.3
    packed = np.packbits(bits, axis=-1, bitorder="little")  # [B, 4 W] bytes, little-endian words
    return packed.view("<i4").astype(np.int32), bits[:, :V]


def test_jnp_numpy_and_llguidance_agree():
    logits = np.random.default_rng(1).standard_normal((4, V)).astype(np.float32)
    mask, bits = random_mask(4)
    want = logits.copy()
    apply_token_bitmask_inplace(want, mask)
    assert (token_mask.allowed_np(mask, V) == bits).all()
    np.testing.assert_array_equal(token_mask.apply_np(logits, mask), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(token_mask.apply)(logits, mask)), want)
    assert np.isneginf(want[~bits]).all() and (want[bits] == logits[bits]).all()


def test_an_all_ones_row_changes_nothing():
    logits = np.random.default_rng(2).standard_normal((3, V)).astype(np.float32)
    ones = token_mask.all_allowed(3, V)
    np.testing.assert_array_equal(np.asarray(token_mask.apply(logits, ones)), logits)
    np.testing.assert_array_equal(token_mask.apply_np(logits, ones), logits)


def test_the_sampler_draws_only_allowed_tokens_greedy_and_sampled():
    B = 6
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((B, V)).astype(np.float32))
    mask = token_mask.all_allowed(B, V)
    mask[1:] = 0
    for r, t in zip(range(1, B), (5, 40, 64, 76, 33)):  # one allowed token per constrained row
        mask[r, t // 32] = np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-2**31)
    free = jax.jit(sample_step)(logits, None, neutral_sampling(B, V), np.asarray(True))[0]
    sp = list(neutral_sampling(B, V))
    sp[-1] = mask
    greedy = jax.jit(sample_step)(logits, None, tuple(sp), np.asarray(True))[0]
    sp[2] = np.full(B, 1.0, np.float32)  # temperature 1: sampled
    sampled = jax.jit(sample_step)(logits, None, tuple(sp), np.asarray(False))[0]
    assert np.asarray(greedy).tolist()[1:] == [5, 40, 64, 76, 33] == np.asarray(sampled).tolist()[1:]
    assert int(greedy[0]) == int(free[0]) == int(jnp.argmax(logits[0]))
