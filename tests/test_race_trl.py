"""The race against TRL, its arithmetic (bench/race_report.py, bench/race_tta.py): the training step leaves the
rollout out, the training side is paired by round per trained token and refuses to call different tokens the
same work, the rollout side divides the generation by decoded tokens, and the time-to-accuracy clock sums the
steps up to the first saved policy that reaches a threshold."""
import pytest

from bench.race_report import build, markdown
from bench.race_tta import clock, reached
from bench.step_report import ROUND


def _rows(rnd: int, step: float, rollout: float, update: float, ref: float, tokens: float = 1000.0,
          decoded: float = 50.0):
    return [{"step": s, "time/step": step, "time/rollout": rollout, "time/rollout/generating": rollout * 0.9,
             "time/update": update, "time/ref_logprobs": ref, "tokens/trained": tokens, "trajectories": 8,
             "decoded_tokens_per_traj": decoded, "turns_per_traj": 2.0, "response_tokens_mean": 100.0,
             ROUND: rnd} for s in (1, 2)]


def _runs(slow=(1.0, 2.0), replay_tokens=1000.0):
    """fastcredit: update 0.8 s, ref 0.2 s, rollout 1 s; TRL's replay: update 1.0, ref 0.25, rollout 0; TRL's own:
    rollout 2 s over twice the decoded tokens. Round 2 runs everything twice as slow."""
    return {"fastcredit": {"rows": [r for n, k in enumerate(slow) for r in _rows(n, 2.1 * k, 1.0 * k, 0.8 * k,
                                                                                 0.2 * k)]},
            "trl_replay": {"rows": [r for n, k in enumerate(slow) for r in _rows(n, 1.3 * k, 0.0, 1.0 * k, 0.25 * k,
                                                                                 replay_tokens)]},
            "trl": {"rows": [r for n, k in enumerate(slow) for r in _rows(n, 3.3 * k, 2.0 * k, 1.0 * k, 0.25 * k,
                                                                          decoded=100.0)]}}


def test_the_training_side_leaves_the_rollout_out_and_pairs_rounds_per_trained_token():
    report = build(_runs())
    step = {r["phase"]: r for r in report["training"]["step"]}
    # fastcredit's step is 2.1 s with a 1 s rollout: 1.1 s of training (ref 0.2 + update 0.8 + 0.1 other)
    assert step["training step"]["fastcredit"]["s"] == pytest.approx(1.65)  # the median of rounds 1.1 and 2.2
    paired = {p["phase"]: p for p in report["training"]["paired"]}
    assert paired["update"]["ratio"] == pytest.approx(0.8) and paired["update"]["per_round"] == pytest.approx([0.8] * 2)
    assert paired["training step"]["ratio"] == pytest.approx(1.1 / 1.3)
    assert paired["reference log-probs"]["lo"] == pytest.approx(0.8) == paired["reference log-probs"]["hi"]
    assert report["training"]["different_tokens"] == []
    assert build(_runs(replay_tokens=999.0))["training"]["different_tokens"] == [1, 2]


def test_the_rollout_side_reads_the_generation_per_decoded_token():
    report = build(_runs())
    gen = {r["phase"]: r for r in report["rollout"]["table"]}["generation"]
    # fastcredit: 0.9 s over 8 x 50 tokens; TRL: 1.8 s over 8 x 100: the same per decoded token
    assert gen["ratio"] == pytest.approx(0.5) and gen["ratio_per_token"] == pytest.approx(1.0)
    paired = {p["phase"]: p for p in report["rollout"]["paired"]}
    assert paired["generation (per decoded token)"]["ratio"] == pytest.approx(1.0)
    assert paired["rollout"]["ratio"] == pytest.approx(0.5)
    text = markdown({**report, "trl": "1.16.0", "device": "cpu", "shape": "tiny", "config": "/x/c.yaml",
                     "overrides": [], "steps": 4, "rounds": 2, "warmup": 1, "start_weights": "ab" * 32,
                     "runs": {n: {"peak": {}, "wall_s": 1.0} for n in ("fastcredit", "trl_replay", "trl")}}, "/x")
    assert "every step's trained tokens are the same" in text and "| update |" in text


def test_time_to_accuracy_sums_the_steps_to_the_first_saved_policy_that_reaches_it():
    rows = [{"step": 1, "time/step": 2.0}, {"step": 2, "time/step": 3.0}, {"step": 3, "time/step": 4.0},
            {"step": 2, "time/step": 5.0}, {"step": 4}]  # step 2 redone after a resume: its last row counts
    assert clock(rows, [0, 2, 4]) == {0: 0.0, 2: 7.0, 4: 11.0}
    points = [{"step": 0, "seconds": 0.0, "em": 0.70}, {"step": 2, "seconds": 7.0, "em": 0.78},
              {"step": 4, "seconds": 11.0, "em": 0.76}]
    assert reached(points, 0.75)["step"] == 2 and reached(points, 0.70)["step"] == 0
    assert reached(points, 0.80) is None
