"""Applying a basis: t ↦ t·Q along the stream dim, in float64 cast back once; slicing (SliceGPT) keeps
the leading PCA directions, shrinks only the stream side, and its norms divide by the full width."""
from __future__ import annotations

import math

import pytest
import torch

import normfold
from normfold import FoldError
from normfold.rotate import kept_directions
from normfold.rotate.apply import rotate_along, sliced_rms_eps
from normfold.train import GPT, GPTConfig

from toys import Stream, token_ids

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")]


def test_rotate_along_multiplies_the_named_dim_by_q():
    t = torch.randn(3, 4, 5, dtype=torch.float64)
    q = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))[0]
    expected = torch.einsum("adc,de->aec", t, q)
    assert torch.allclose(rotate_along(t, 1, q), expected, rtol=0, atol=1e-13)
    assert rotate_along(t, 1, q[:, :2], scale=2.0).shape == (3, 2, 5)


def test_rotate_along_computes_in_float64_and_rounds_once():
    t = torch.randn(64, 32, dtype=torch.float32)
    q = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0]
    once = (t.double() @ q).float()
    assert torch.equal(rotate_along(t, 1, q), once) and rotate_along(t, 1, q).dtype == torch.float32


def test_rotate_along_refuses_a_dim_of_another_size():
    with pytest.raises(ValueError, match="must have Q's 8 rows"):
        rotate_along(torch.zeros(3, 4), 1, torch.eye(8, dtype=torch.float64))


def test_sliced_norm_divides_by_the_full_width():
    # x / sqrt(|x|²/d + eps) = sqrt(d/k) · x / sqrt(|x|²/k + eps·d/k)
    d, k, eps = 32, 24, 1e-5
    x = torch.randn(7, k, dtype=torch.float64)
    full = x / torch.sqrt(x.square().sum(-1, keepdim=True) / d + eps)
    norm = torch.nn.functional.rms_norm(x, (k,), eps=sliced_rms_eps(eps, d, k))
    assert torch.allclose(math.sqrt(d / k) * norm, full, rtol=1e-14, atol=0)


@pytest.mark.parametrize("fraction, kept", [(0.0, 32), (0.1, 28), (0.25, 24), (0.5, 16), (0.97, 0)])
def test_kept_directions_round_down_as_slicegpt(fraction, kept):
    assert kept_directions(32, fraction) == kept


def _calibration(zoo, n: int = 3) -> list[dict]:
    generator = torch.Generator().manual_seed(11)
    calls = []
    for _ in range(n):
        ids = torch.randint(0, 100, (2, 16), generator=generator)
        calls.append({"input_ids": ids, "labels": ids, "use_cache": False})
    return calls


def test_slicing_gpt2_shrinks_only_the_stream_side_and_reports_the_cost(zoo):
    model = zoo.model("gpt2", torch.float32)
    sliced, report = normfold.rotate(model, zoo.inputs("gpt2", 0), method="pca", calibration=_calibration(zoo),
                                     slice_fraction=0.25)
    h = sliced.transformer.h[0]
    assert sliced.transformer.wte.weight.shape == (100, 24) and sliced.transformer.wpe.weight.shape == (64, 24)
    assert h.attn.c_attn.weight.shape == (24, 96) and h.attn.c_proj.weight.shape == (32, 24)  # heads unchanged
    assert h.mlp.c_fc.weight.shape == (24, 128) and h.mlp.c_proj.weight.shape == (128, 24)   # MLP width unchanged
    assert h.attn.c_proj.nf == 24 and sliced.lm_head.in_features == 24
    assert h.ln_1.normalized_shape == (24,) and h.ln_1.weight is None
    assert h.ln_1.eps == pytest.approx(sliced_rms_eps(model.transformer.h[0].ln_1.eps, 32, 24))
    assert report.verification.ok and report.verification.model_dtype_max_rel_error is None and not report.exact
    assert report.streams[0].kept == 24 and 0.5 < report.streams[0].kept_energy < 1.0
    agreement = report.slicing.agreement
    assert 0.5 < agreement.min_cosine <= agreement.mean_cosine < 1.0
    original_loss, sliced_loss = agreement.losses["out['loss']"]
    assert original_loss > 0 and sliced_loss > 0
    logits = sliced(input_ids=token_ids(1, 5, seed=3) % 100, use_cache=False).logits
    assert logits.shape == (1, 5, 100) and torch.isfinite(logits).all()
    assert "sliced 25% (approximate, not proved)" in str(report)
    assert "the whole rotation, before slicing: verify: OK" in str(report)


def _low_rank_stream(rank: int) -> Stream:
    """A stream whose writers all write inside one rank-``rank`` subspace (embedding, positions, MLP output)."""
    torch.manual_seed(0)
    model = Stream("ln").double().eval()
    basis = torch.linalg.qr(torch.randn(16, rank, dtype=torch.float64))[0]
    projector = basis @ basis.T
    with torch.no_grad():
        model.embed.weight.copy_(model.embed.weight @ projector)
        model.pos.copy_(model.pos @ projector)
        model.fc2.weight.copy_(projector @ model.fc2.weight)
        model.fc2.bias.copy_(projector @ model.fc2.bias)
    return model


def test_slicing_away_directions_that_carry_no_energy_is_exact():
    # The fold's centering keeps every writer inside the rank-11 subspace, so PCA finds it and keeping
    # 12 of the 16 directions loses nothing, provided the sliced norm divides by the full width 16
    # (dividing by 12 would scale every normalized row by sqrt(16/12)).
    model = _low_rank_stream(rank=11)
    calibration = [(token_ids(4, 6, seed=s),) for s in range(3)]
    sliced, report = normfold.rotate(model, (token_ids(),), method="pca", calibration=calibration,
                                     slice_fraction=0.25)
    assert report.streams[0].kept == 12 and report.streams[0].kept_energy == pytest.approx(1.0, abs=1e-12)
    assert report.slicing.agreement.max_rel_error <= 1e-9
    fresh = (token_ids(3, 5, seed=9),)
    expected = model(*fresh)
    assert (sliced(*fresh) - expected).abs().max() <= 1e-9 * expected.abs().max()


def test_slicing_into_directions_that_carry_energy_changes_the_outputs():
    model = _low_rank_stream(rank=11)
    _, report = normfold.rotate(model, (token_ids(),), method="pca", slice_fraction=0.5,
                                calibration=[(token_ids(4, 6, seed=s),) for s in range(3)])
    assert report.streams[0].kept_energy < 0.999 and report.slicing.agreement.max_rel_error > 1e-3


def test_pca_without_slicing_is_an_exact_rotation(zoo):
    model = zoo.model("gpt2", torch.float64)
    rotated, report = normfold.rotate(model, zoo.inputs("gpt2", 0), method="pca", calibration=_calibration(zoo))
    assert report.exact and report.verification.ok and report.streams[0].kept == 32
    assert report.streams[0].identity_distance > 0.1 and report.streams[0].orthogonality_error <= 1e-12


def test_a_fraction_that_keeps_no_direction_is_refused(zoo):
    with pytest.raises(ValueError, match="leaves 0 of the 32 directions"):
        normfold.rotate(zoo.model("gpt2"), zoo.inputs("gpt2", 0), method="pca", calibration=_calibration(zoo),
                        slice_fraction=0.99)


def test_slicing_a_tied_table_that_writes_and_reads_is_refused():
    torch.manual_seed(0)
    model = Stream("rms", tap="tied").double().eval()
    with pytest.raises(FoldError, match="cannot slice: embed.weight both writes the stream and reads"):
        normfold.rotate(model, (token_ids(),), method="pca", calibration=[(token_ids(),)], slice_fraction=0.25)


@pytest.mark.parametrize("slice_fraction", [0.0, 0.25], ids=["rotation", "slicing"])
def test_a_rotation_off_by_one_part_per_million_is_caught_by_the_proof(monkeypatch, slice_fraction):
    # the float64 proof judges the rotation itself: sliced or not, nothing comes back when it is wrong
    from normfold.rotate import apply

    exact = apply.rotate_along
    monkeypatch.setattr(apply, "rotate_along", lambda t, dim, q, scale=1.0: exact(t, dim, q, scale * (1 + 1e-6)))
    torch.manual_seed(0)
    model = Stream("ln").double().eval()
    with pytest.raises(normfold.FoldVerificationError, match="rotated model differs from the original"):
        normfold.rotate(model, (token_ids(),), method="pca", calibration=[(token_ids(),)],
                        slice_fraction=slice_fraction)


def test_a_model_whose_code_reads_the_stream_width_is_refused_when_sliced_not_crashed():
    # normfold.train.GPT splits q, k, v by x.shape[-1]: at the sliced width its attention breaks
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=16, tie_embeddings=False)).eval()
    calls = [(token_ids(2, 8, seed=s) % 256,) for s in range(2)]
    with pytest.raises(FoldError, match=r"cannot slice: the sliced model does not run \(ValueError: .*x\.shape\[-1\]"):
        normfold.rotate(model, calls[0], method="pca", calibration=calls, slice_fraction=0.25)
    rotated, report = normfold.rotate(model, calls[0], method="pca", calibration=calls)  # unsliced: exact
    assert report.verification.ok
