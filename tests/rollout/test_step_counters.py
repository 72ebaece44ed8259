"""The engines' step counters (``engine/*`` in a rollout's metrics, issue 60 item 6): sequences in flight a step,
the steps that took new requests in and their seconds, prompt tokens and the prefix cache's share, decoded tokens;
counted afresh for each rollout."""
import pytest

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.models.tiny import build_tiny_policy
from fastcredit.rollout.agent import AgentLimits, AgentLoop
from fastcredit.rollout.engines import HFEngine, SamplingParams
from fastcredit.rollout.engines.steploop import StepLoop


class Request:
    def __init__(self, rid, prompt, steps, cached):
        self.request_id, self.prompt_token_ids, self.num_cached_tokens = rid, prompt, cached
        self.left, self.finished, self.outputs = steps, False, []


class ScriptedEngine:
    """vLLM's LLMEngine as StepLoop drives it: each request decodes one token a step for its scripted number of
    steps (``plan[len(prompt)] = (steps, cached prompt tokens)``); ``on_step`` runs inside the first step."""

    def __init__(self, plan, on_step=None):
        self.plan, self.on_step, self.running, self.calls = plan, on_step, {}, 0

    def add_request(self, rid, prompt, params):
        steps, cached = self.plan[len(prompt)]
        self.running[rid] = Request(rid, prompt, steps, cached)

    def abort_request(self, rids):
        for rid in rids:
            self.running.pop(rid, None)

    def step(self):
        self.calls += 1
        if self.calls == 1 and self.on_step is not None:
            self.on_step()
        done = []
        for r in list(self.running.values()):
            r.left -= 1
            if r.left == 0:
                r.finished = True
                r.outputs = [type("Completion", (), {"token_ids": [7] * self.plan[len(r.prompt_token_ids)][0]})()]
                done.append(self.running.pop(r.request_id))
        return done


def test_the_step_loop_counts_sequences_admissions_and_cached_prompt_tokens():
    """A (10 prompt tokens, 4 of them cached, 3 steps) runs alone, B (6 tokens, 1 step) joins at step 2: steps 1 and
    2 admit, step 3 decodes A alone."""
    settled = []
    loop = None

    def submit_b():
        loop.submit(list(range(6)), "p", lambda res, err: settled.append(res), start=False)

    engine = ScriptedEngine({10: (3, 4), 6: (1, 0)}, on_step=submit_b)
    loop = StepLoop(engine, render=lambda p: p, params=lambda p: p, convert=lambda o, p, version: o)
    loop.submit(list(range(10)), "p", lambda res, err: settled.append(res), start=False)
    loop.drive(lambda: len(settled) == 2)
    c = loop.take_counters()
    assert c["engine/steps"] == 3 and c["engine/seqs_per_step"] == pytest.approx(4 / 3)
    assert c["engine/admit_steps"] == 2 and c["engine/decode_seqs_per_step"] == 1.0
    assert c["engine/prompt_tokens"] == 16 and c["engine/cached_tokens"] == 4
    assert c["engine/prefix_hit_rate"] == pytest.approx(0.25) and c["engine/decoded_tokens"] == 4
    assert c["engine/admit_step_s"] + c["engine/decode_step_s"] == pytest.approx(c["engine/step_s"])
    assert loop.take_counters()["engine/steps"] == 0  # taken: counted afresh
    loop.close()


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(["<search>where is the river</search> <answer>Paris</answer> hello world"] * 30,
                                vocab_size=320)


def test_the_hf_engine_counts_its_forwards(tok):
    """One prefill forward over 3 rows, then a decode forward a token until the last row is done: 4 tokens each is
    1 + 3 forwards of 3 rows."""
    eng = HFEngine(build_tiny_policy(tok, hidden=32, layers=2, heads=2, seed=0), tok)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("hello world", "where is", "the river is")]
    eng.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    c = eng.take_step_counters()
    assert (c["engine/steps"], c["engine/admit_steps"], c["engine/seqs_per_step"]) == (4, 1, 3.0)
    assert c["engine/prompt_tokens"] == sum(len(p) for p in prompts) and c["engine/decoded_tokens"] == 12
    assert eng.take_step_counters()["engine/steps"] == 0


def test_a_rollout_reports_its_own_engine_steps(tok):
    """The rollout's metrics carry its engine's counters, not what the engine did before it (a judge, an evaluation)."""
    eng = HFEngine(build_tiny_policy(tok, hidden=32, layers=2, heads=2, seed=0), tok)
    eng.generate([tok("hello world", add_special_tokens=False)["input_ids"]], SamplingParams(max_tokens=9))

    def searcher(queries):
        return [([5, 6], ["d"]) for _ in queries]

    agent = AgentLoop(eng, searcher, AgentLimits(max_turns=2, max_action_tokens=5, max_obs_tokens=8,
                                                 max_response_tokens=40),
                      SamplingParams(max_tokens=5, temperature=0.0), mode="lockstep")
    res = agent.run([tok("where is the river", add_special_tokens=False)["input_ids"]] * 2)
    decoded = sum(e.decoded_tokens for e in res.episodes)
    assert res.stats["engine/decoded_tokens"] == decoded == res.stats["decoded_tokens_per_traj"] * 2
    assert res.stats["engine/steps"] >= res.stats["turns_per_traj"]
