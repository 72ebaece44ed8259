"""The turn surrogate's candidate variants (issue 46; kernels/turn_surrogate/README.md, "Variants") against the
float64 reference with the default kernel's tolerances: unpredicated ("stream") loads and the persistent grid."""
import pytest
import torch

from fastcredit.config.loss import LossConfig
from fastcredit.kernels.turn_surrogate import SurrogateLaunch, turn_surrogate_loss, turn_surrogate_naive
from fastcredit.kernels.turn_surrogate import triton as ts_triton
from fastcredit.trainer.loss import AGG_MODES

from test_turn_surrogate import DTYPES, FULL, LAYOUTS, assert_close, make_inputs, make_layout, reference, run

VARIANTS = ("stream", "persistent")


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", ["N1000-S37", "N63-S5"])
def test_variant_matches_reference(layout, variant, dtype_name, mode):
    N, S, B, seed = LAYOUTS[layout]
    dtype = DTYPES[dtype_name]
    seg, traj = make_layout(N, S, B, seed)
    x = make_inputs(seg, traj, seed, dtype)
    cfg = LossConfig(agg_mode=mode, **FULL)
    g = torch.tensor(1.7)
    got = run(turn_surrogate_loss, seg, traj, x, cfg, g, block=128, launch=SurrogateLaunch(variant))
    ref = reference(seg, traj, x, cfg, g)
    naive_lowp = run(turn_surrogate_naive, seg, traj, x, cfg, g) if dtype != torch.float32 else None
    assert_close(got, ref, dtype, naive_lowp)


@pytest.mark.parametrize("variant", ("masked",) + VARIANTS)
def test_uncounted_tokens_may_hold_anything(variant):
    """stream loads observation and masked tokens too: whatever they hold (NaN, inf) must not reach the loss,
    the metrics or the gradients, as with the masked loads that never read them."""
    seg, traj = make_layout(777, 120, 30, 2)
    x = make_inputs(seg, traj, 2, torch.float32, per_token_adv=True)
    cfg = LossConfig(agg_mode="turn-mean", **FULL)
    g = torch.tensor(0.8)
    ref = reference(seg, traj, x, cfg, g)
    uncounted = (seg < 0) | ~x["loss_mask_N"]
    for k in ("logp_N", "old_logp_N", "ref_logp_N", "entropy_N", "weight_N", "adv_N"):
        x[k] = torch.where(uncounted, torch.tensor(float("nan")), x[k])
    x["old_logp_N"] = torch.where(uncounted & (seg < 0), torch.tensor(float("-inf")), x["old_logp_N"])
    got = run(turn_surrogate_loss, seg, traj, x, cfg, g, block=128, launch=SurrogateLaunch(variant))
    ref_d = {"loss": ref[0], **ref[1]}
    for k, v in {"loss": got[0], **got[1]}.items():
        assert torch.isfinite(v).all() and abs(v.item() - ref_d[k].item()) <= 1e-5 * max(abs(ref_d[k].item()), 1e-3), k
    counted = ~uncounted
    torch.testing.assert_close(got[2][counted].double().cpu(), ref[2][counted], rtol=1e-5, atol=1e-9)
    assert not got[2][uncounted].any() and not got[3][uncounted].any()


def test_persistent_grid_walks_several_blocks(monkeypatch):
    """One program walking every block alone still matches the reference (and the default's loss to rounding)."""
    monkeypatch.setattr(ts_triton, "resident_programs", lambda device, per_sm: 1)
    seg, traj = make_layout(1000, 37, 9, 3)
    x = make_inputs(seg, traj, 3, torch.float32)
    cfg = LossConfig(agg_mode="seq-mean-token-mean", **FULL)
    g = torch.tensor(1.0)
    got = run(turn_surrogate_loss, seg, traj, x, cfg, g, block=64, launch=SurrogateLaunch("persistent"))
    assert_close(got, reference(seg, traj, x, cfg, g), torch.float32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_deterministic(variant):
    seg, traj = make_layout(1000, 37, 9, 5)
    x = make_inputs(seg, traj, 5, torch.float32)
    cfg = LossConfig(agg_mode="turn-mean", **FULL)
    runs = [run(turn_surrogate_loss, seg, traj, x, cfg, torch.tensor(1.0), block=128,
                launch=SurrogateLaunch(variant)) for _ in range(3)]
    for other in runs[1:]:
        assert torch.equal(other[0], runs[0][0]) and torch.equal(other[2], runs[0][2])
        assert torch.equal(other[3], runs[0][3])
        assert all(torch.equal(other[1][k], runs[0][1][k]) for k in runs[0][1])


def test_unknown_variant_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid: masked, stream, persistent"):
        SurrogateLaunch("vector")
