"""Each compressor on known inputs, serially (a group of one: the sum over ranks is this
rank's own C(Δ), so `out` shows exactly what the compressor sends); the bad --compress
values; the bf16 rounding against integer arithmetic and PyTorch."""

import struct

import numpy as np
import pytest

from minidp import comm
from minidp.cli.training.config import BadConfig, TrainConfig
from minidp.cli.training.loop import train
from minidp.parallel.compression.cast import from_bf16, to_bf16
from minidp.parallel.compression.lowrank import orthogonalize
from minidp.parallel.compression.quant import pack_codes, unpack_codes
from minidp.parallel.compression.sparse import top_k_indices
from minidp.parallel.compression.table import COMPRESSORS, make_compressor, parse_compress


def compress_once(spec: str, x: np.ndarray, shapes=None, compressor=None, key=0) -> np.ndarray:
    """What compressor(spec) sends for x (a copy; x is left alone)."""
    compressor = compressor or make_compressor(spec, seed=5)
    out = x.copy()
    compressor.reduce(out, key, comm.world(), shapes)
    return out


# ---- bf16 by hand ------------------------------------------------------------------------------
def bf16_reference(value: float) -> int:
    """Round a float32 to bf16 bits with Python integers: keep the top 16 bits, round the
    bottom 16 to nearest, ties to the even top; NaN stays a quiet NaN."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    top, low = bits >> 16, bits & 0xFFFF
    if (bits >> 23) & 0xFF == 0xFF and bits & 0x7FFFFF:
        return top | 0x40
    if low > 0x8000 or (low == 0x8000 and top % 2 == 1):
        top += 1
    return top


def bf16_cases() -> np.ndarray:
    """Specials, two ties (the last two before the 5,000 random bit patterns)."""
    special = [0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan, 3.4028235e38, 1e-45, -1e-40]
    ties = [struct.unpack("<f", struct.pack("<I", b))[0] for b in (0x3F808000, 0x3F818000)]
    bits = np.random.default_rng(0).integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([np.array(special + ties, np.float32), bits.view(np.float32)])


def test_bf16_rounds_to_nearest_even_like_integer_arithmetic():
    x = bf16_cases()
    got = to_bf16(x)
    want = np.array([bf16_reference(v) for v in x.tolist()], np.uint16)
    np.testing.assert_array_equal(got, want)
    assert list(got[-5002:-5000]) == [0x3F80, 0x3F82]  # the two ties: down to even, up to even
    np.testing.assert_array_equal(from_bf16(np.array([0x3F80, 0xC0A0], np.uint16)), [1.0, -5.0])


@pytest.mark.torch
def test_bf16_rounds_as_torch_does():
    import torch

    x = bf16_cases()
    got = to_bf16(x)
    finite = np.isfinite(x)
    theirs = torch.from_numpy(x[finite]).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(got[finite], theirs.view(np.uint16))


# ---- each compressor's round trip on known inputs ----------------------------------------------
def test_casts_send_what_a_16_bit_cast_keeps():
    x = np.array([1.0, 1 + 2**-9, -3e-8, 70000.0, 0.1], np.float32)
    with np.errstate(over="ignore"):  # 70000 is past fp16: infinity
        np.testing.assert_array_equal(compress_once("fp16", x), x.astype(np.float16))
    np.testing.assert_array_equal(compress_once("bf16", x), from_bf16(to_bf16(x)))


def test_top_k_keeps_exactly_the_k_largest_magnitudes_ties_to_the_lower_index():
    x = np.array([0.5, -3.0, 2.0, -2.0, 0.1, 2.0, 7.0, -0.2])
    np.testing.assert_array_equal(top_k_indices(x, 3), [1, 2, 6])  # -2 (3) and 2 (5) lose the tie
    np.testing.assert_array_equal(top_k_indices(x, 4), [1, 2, 3, 6])
    sent = compress_once("topk:0.5", x)  # k = 4
    np.testing.assert_array_equal(sent, [0, -3.0, 2.0, -2.0, 0, 0, 7.0, 0])
    rng = np.random.default_rng(1)
    y = rng.standard_normal(1000)
    sent = compress_once("topk:0.01", y)
    assert np.count_nonzero(sent) == 10
    assert np.abs(y[sent == 0]).max() <= np.abs(y[sent != 0]).min()


def test_random_k_sends_k_values_as_they_are():
    x = np.random.default_rng(2).standard_normal(1000) + 10
    sent = compress_once("randomk:0.05", x)
    np.testing.assert_array_equal(sent[sent != 0], x[sent != 0])
    assert np.count_nonzero(sent) == 50


def test_sign_sends_the_mean_magnitude_times_the_sign():
    x = np.array([0.5, -1.5, 0.0, 2.0, -1.0])
    np.testing.assert_array_equal(compress_once("sign", x), [1, -1, 1, 1, -1])  # mean |x| = 1
    np.testing.assert_array_equal(compress_once("sign-noef", 2 * x), [2, -2, 2, 2, -2])
    codes = np.random.default_rng(3).integers(0, 9, 101).astype(np.uint8)
    assert pack_codes(codes, 4).size == 51  # 101 four-bit codes in 51 bytes
    np.testing.assert_array_equal(unpack_codes(pack_codes(codes, 4), 4, 101), codes)


def test_qsgd_lands_on_its_levels_and_is_unbiased_over_seeds():
    x = np.array([0.3, -1.2, 0.05, 0.0, 2.0, -0.7])
    S, norm = 4, np.linalg.norm(x)
    draws = np.array([compress_once("qsgd:4", x, compressor=make_compressor("qsgd:4", seed=s))
                      for s in range(2000)])  # fmt: skip
    levels = draws / norm * S
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-9)
    assert np.all(np.abs(levels) <= S) and np.all(draws[:, 3] == 0)
    # each level is one of two neighbours, so the variance per draw is at most (norm/S)²/4
    standard_error = norm / S / 2 / np.sqrt(len(draws))
    np.testing.assert_allclose(draws.mean(axis=0), x, atol=5 * standard_error)


def test_powersgd_reproduces_a_low_rank_matrix_and_sends_vectors_as_they_are():
    rng = np.random.default_rng(4)
    M = rng.standard_normal((20, 2)) @ rng.standard_normal((2, 30))  # rank 2
    bias, tiny = rng.standard_normal(7), rng.standard_normal((2, 2))  # (2+2)·2 >= 2·2
    x = np.concatenate([M.ravel(), bias, tiny.ravel()])
    sent = compress_once("powersgd:2", x, shapes=[M.shape, bias.shape, tiny.shape])
    np.testing.assert_allclose(sent[:600], M.ravel(), atol=1e-10)
    np.testing.assert_array_equal(sent[600:], x[600:])
    one = compress_once("powersgd:1", x, shapes=[M.shape, bias.shape, tiny.shape])
    assert np.linalg.matrix_rank(one[:600].reshape(20, 30), tol=1e-8) == 1
    P = orthogonalize(rng.standard_normal((9, 3)))
    np.testing.assert_allclose(P.T @ P, np.eye(3), atol=1e-12)


def test_powersgd_warm_starts_from_the_summed_q():
    """Q_1 = M_1ᵀ orthogonalize(M_1 Q_0), Q_0 the shared seed's; round 2 starts from Q_1."""
    rng = np.random.default_rng(9)
    M1, M2 = rng.standard_normal((2, 8, 6))
    compressor = make_compressor("powersgd:1", seed=3)
    Q0 = np.random.default_rng([3, 0]).standard_normal((6, 1))
    compress_once("", M1.ravel(), [M1.shape], compressor)
    Q1 = M1.T @ orthogonalize(M1 @ Q0)
    np.testing.assert_allclose(compressor.warm[0][0], Q1, rtol=1e-12)
    sent = compress_once("", M2.ravel(), [M2.shape], compressor)
    delta = M2 + (M1 - orthogonalize(M1 @ Q0) @ Q1.T)  # the gradient and the residual
    P2 = orthogonalize(delta @ Q1)
    np.testing.assert_allclose(sent.reshape(8, 6), P2 @ (delta.T @ P2).T, rtol=1e-10)


# ---- error feedback ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["topk:0.1", "randomk:0.1", "sign", "powersgd:1"])
def test_error_feedback_conserves_mass(spec):
    """sent + e_new == g + e_old: bit for bit for the sparsifiers (what they send leaves
    the residual exactly zero), to the last rounding for the others."""
    rng = np.random.default_rng(6)
    compressor, shapes = make_compressor(spec, seed=7), [(12, 10), (8,)]
    for _ in range(3):
        g = rng.standard_normal(128)
        before = compressor.residuals.get(0, np.zeros(128)).copy()
        sent = compress_once(spec, g, shapes, compressor)
        after = compressor.residuals[0]
        if spec.startswith(("topk", "randomk")):
            np.testing.assert_array_equal(sent + after, g + before)
            assert np.all(after[sent != 0] == 0)
        else:
            np.testing.assert_allclose(sent + after, g + before, rtol=0, atol=1e-14)
    assert compressor.residual_norm() == pytest.approx(np.linalg.norm(after))
    warm_q = 10 * 1 * 8 if spec.startswith("powersgd") else 0  # Q: m x r float64
    assert compressor.nbytes() == after.nbytes + warm_q  # what memory_bytes counts
    assert 0 < compressor.relative_error() < 1


def test_without_error_feedback_there_is_no_residual():
    for spec in ("fp16", "bf16", "sign-noef", "qsgd:2"):
        compressor = make_compressor(spec)
        compress_once(spec, np.ones(10), compressor=compressor)
        assert compressor.residuals == {} and compressor.residual_norm() is None


def test_state_dict_carries_residuals_rounds_and_the_warm_start():
    rng = np.random.default_rng(8)
    grads, shapes = [rng.standard_normal(60) for _ in range(4)], [(6, 10)]
    for spec in ("powersgd:2", "randomk:0.2"):
        straight, first = make_compressor(spec, seed=1), make_compressor(spec, seed=1)
        want = [compress_once(spec, g, shapes, straight) for g in grads]
        got = [compress_once(spec, g, shapes, first) for g in grads[:2]]
        second = make_compressor(spec, seed=1)
        second.load_state_dict(first.state_dict())
        got += [compress_once(spec, g, shapes, second) for g in grads[2:]]
        np.testing.assert_array_equal(got, want)


# ---- the flag ----------------------------------------------------------------------------------
def test_parse_defaults_and_every_name():
    assert parse_compress("none") == ("none", None) and make_compressor("none") is None
    assert parse_compress("topk") == ("topk", 0.01) and parse_compress("powersgd:4") == (
        "powersgd",
        4,
    )
    names = {"fp16", "bf16", "topk", "randomk", "sign", "sign-noef", "qsgd", "powersgd"}
    assert set(COMPRESSORS) == names


@pytest.mark.parametrize(
    "spec, message",
    [
        ("zip", "unknown compressor 'zip'"),
        ("topk:0", "density must be in (0, 1]"),
        ("randomk:1.5", "density must be in (0, 1]"),
        ("topk:nan", "density must be in (0, 1]"),
        ("powersgd:0", "rank must be an integer >= 1"),
        ("powersgd:1.5", "rank must be an integer >= 1"),
        ("qsgd:200", "an integer in [1, 127]"),
        ("sign:3", "takes no parameter"),
        ("topk:x", "'x' is not a number"),
    ],
)
def test_bad_values_are_one_clear_line(spec, message):
    with pytest.raises(BadConfig) as error:
        train(TrainConfig(compress=spec, steps=1, model="mlp", hidden=8))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_compression_is_a_flag_of_data_parallelism_only():
    with pytest.raises(BadConfig, match="--compress is a flag of --strategy dp"):
        TrainConfig(strategy="ps", compress="topk").validate()


def test_the_command_line_says_a_bad_value_in_one_line_and_exits_2(capsys):
    from minidp.cli.commands import main

    with pytest.raises(SystemExit) as done:
        main(["--compress", "powersgd:0", "--steps", "1", "--model", "mlp", "--hidden", "8"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the rank must be an integer >= 1" in err


def test_compression_and_pruning_are_not_combined_yet():
    with pytest.raises(BadConfig, match="--prune together with --compress"):
        TrainConfig(prune=0.5, compress="topk").validate()
