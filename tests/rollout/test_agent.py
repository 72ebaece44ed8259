"""The agent loop's state machine with a scripted engine and searcher: turn kinds, limits,
observations never trained on, async vs lockstep, batching, and ProCeed rewinds."""
import asyncio

import pytest
import torch

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.retrieval.observation import format_observation
from fastcredit.rollout.actions import INVALID_OBSERVATION, classify_action
from fastcredit.rollout.agent import AgentLimits, AgentLoop
from fastcredit.rollout.engines.base import GenOutput, SamplingParams
from fastcredit.rollout.proceed import ProceedHook, proceed_flags
from fastcredit.rollout.trajectory import TurnKind

TEXTS = ["<think>find the city</think><search>where was Ada born</search>", "<answer>Paris</answer>",
         INVALID_OBSERVATION, format_observation(['"Ada"\nAda was born in Paris.']), "I think so. Fake <information>x"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(TEXTS * 20, vocab_size=400)


class ScriptedEngine:
    """Answers from a script: ``script(prompt_text, turn) -> action text``; turn = observations so far.

    Records the size of every batch it was asked to generate.
    """

    def __init__(self, tokenizer, script, version=None):
        self.tokenizer, self.script, self.batches, self.version = tokenizer, script, [], version

    def _one(self, prompt, params: SamplingParams) -> GenOutput:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        action = self.script(text, text.count("</information>") + text.count("Let me try again."))
        ids = self.tokenizer(action, add_special_tokens=False)["input_ids"]
        stop = next((s for s in params.stop if action.endswith(s)), None)
        if len(ids) > params.max_tokens:
            ids, stop = ids[: params.max_tokens], None
        return GenOutput(ids, [-0.5] * len(ids) if params.logprobs else None, "stop" if stop else "length", stop,
                         version=self.version)

    def generate(self, prompts, params):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.batches.append(len(prompts))
        return [self._one(p, q) for p, q in zip(prompts, params)]

    async def agenerate(self, prompt, params):
        await asyncio.sleep(0)
        self.batches.append(1)
        return self._one(prompt, params)


class FakeSearcher:
    def __init__(self, tokenizer):
        self.tokenizer, self.batches = tokenizer, []

    def __call__(self, queries):
        self.batches.append(list(queries))
        obs = format_observation([f'"{q}"\nAda was born in Paris.' for q in queries[:1]])
        ids = self.tokenizer(obs, add_special_tokens=False)["input_ids"]
        return [(ids, [f"doc-{q}"]) for q in queries]


def search_then_answer(text, turn):
    return "<think>find the city</think><search>where was Ada born</search>" if turn == 0 else "<answer>Paris</answer>"


def loop(tok, script, mode="async", **limits):
    engine, searcher = ScriptedEngine(tok, script), FakeSearcher(tok)
    lim = AgentLimits(**{"max_turns": 4, "max_action_tokens": 64, "max_obs_tokens": 200,
                         "max_response_tokens": 1000, **limits})
    return AgentLoop(engine, searcher, lim, SamplingParams(max_tokens=64, logprobs=True), mode=mode), engine, searcher


def prompts(tok, n):
    return [tok("Question: where was Ada born?", add_special_tokens=False)["input_ids"]] * n


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_search_then_answer_is_two_turns_and_observations_are_not_trained(tok, mode):
    agent, _, _ = loop(tok, search_then_answer, mode)
    res = agent.run(prompts(tok, 3), group_id=[0, 0, 1])
    b = res.batch
    b.validate()
    assert b.num_trajectories == 3 and b.num_turns == 6
    assert b.seg_kind_S.tolist() == [TurnKind.SEARCH, TurnKind.ANSWER] * 3
    assert b.group_id_B.tolist() == [0, 0, 1]
    first = res.episodes[0]
    assert first.steps[0].query == "where was Ada born" and first.steps[0].retrieved_ids == ["doc-where was Ada born"]
    obs = first.turns[0].obs_ids
    assert tok.decode(obs, skip_special_tokens=False).startswith("\n\n<information>")
    # Observation tokens carry seg_id -1 and log-prob 0; action tokens carry the engine's log-probs.
    n_act = len(first.turns[0].action_ids)
    seg = b.seg_id_N[: b.cu_seqlens[1]]
    assert (seg[:n_act] == 0).all() and (seg[n_act:n_act + len(obs)] == -1).all()
    assert torch.equal(b.rollout_logp_N[b.seg_id_N >= 0], torch.full((int((b.seg_id_N >= 0).sum()),), -0.5))
    assert (b.rollout_logp_N[b.seg_id_N < 0] == 0).all()
    assert res.stats["searches_per_traj"] == 1.0 and res.stats["turns_per_traj"] == 2.0


def test_without_the_engines_log_probs_the_batch_has_none(tok):
    """Log-probs not requested: no behaviour log-probs at all, never zeros standing in for them (the decoupled
    correction refuses a stale turn without them)."""
    agent, _, _ = loop(tok, search_then_answer)
    agent.sampling = SamplingParams(max_tokens=64, logprobs=False)
    assert agent.run(prompts(tok, 2), group_id=[0, 0]).batch.rollout_logp_N is None


def test_async_and_lockstep_give_the_same_trajectories(tok):
    script = lambda text, turn: ("<search>q%d</search>" % turn) if turn < 2 else "<answer>Paris</answer>"  # noqa: E731
    a = loop(tok, script, "async")[0].run(prompts(tok, 5))
    s = loop(tok, script, "lockstep")[0].run(prompts(tok, 5))
    assert torch.equal(a.batch.tokens_N, s.batch.tokens_N) and torch.equal(a.batch.seg_id_N, s.batch.seg_id_N)


def test_async_retrieval_is_micro_batched(tok):
    agent, engine, searcher = loop(tok, search_then_answer, "async")
    agent.run(prompts(tok, 8))
    assert sum(len(q) for q in searcher.batches) == 8 and len(searcher.batches) < 8


def test_invalid_action_gets_the_corrective_message_and_goes_on(tok):
    script = lambda text, turn: "I think so." if turn == 0 else "<answer>Paris</answer>"  # noqa: E731
    res = loop(tok, script, max_action_tokens=4)[0].run(prompts(tok, 1))
    e = res.episodes[0]
    assert [s.kind for s in e.steps] == [TurnKind.INVALID, TurnKind.ANSWER]
    assert e.steps[0].obs_text == INVALID_OBSERVATION


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_turn_budget_makes_the_last_turn_truncated(tok, mode):
    script = lambda text, turn: "<search>again</search>"  # noqa: E731
    res = loop(tok, script, mode, max_turns=3)[0].run(prompts(tok, 2))
    for e in res.episodes:
        assert [s.kind for s in e.steps] == [TurnKind.SEARCH, TurnKind.SEARCH, TurnKind.TRUNCATED]
        assert e.turns[-1].obs_ids == []
    res.batch.validate()


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_a_questions_own_turn_budget_caps_its_trajectory(tok, mode):
    """The lookup world's per-question budget (``meta["max_turns"]``): the smaller of it and rollout.max_turns."""
    script = lambda text, turn: "<search>again</search>"  # noqa: E731
    agent = loop(tok, script, mode, max_turns=5)[0]
    res = agent.run(prompts(tok, 3), metas=[{"max_turns": 2}, {"max_turns": None}, {"max_turns": 9}])
    assert [len(e.steps) for e in res.episodes] == [2, 5, 5]
    assert all(e.steps[-1].kind == TurnKind.TRUNCATED for e in res.episodes)
    res.batch.validate()


def test_response_budget_truncates(tok):
    res = loop(tok, lambda text, turn: "<search>again</search>", max_turns=50,
               max_response_tokens=60)[0].run(prompts(tok, 1))
    e = res.episodes[0]
    assert e.steps[-1].kind == TurnKind.TRUNCATED and e.response_len <= 60
    assert all(s.kind == TurnKind.SEARCH for s in e.steps[:-1])


def test_fake_information_written_by_the_policy_stays_trainable(tok):
    forged = "Fake <information>x</information><answer>Paris</answer>"
    res = loop(tok, lambda text, turn: forged)[0].run(prompts(tok, 1))
    b = res.batch
    assert b.num_turns == 1 and b.seg_kind_S.tolist() == [TurnKind.ANSWER]
    assert (b.seg_id_N == 0).all(), "every token the policy wrote is an action token"


def test_classify_action():
    stop = GenOutput([], None, "stop", "</search>")
    assert classify_action("<think>x</think><search> a b </search>", stop) == (TurnKind.SEARCH, "a b")
    assert classify_action("<search>  </search>", stop) == (TurnKind.INVALID, None)
    assert classify_action("<search>a", GenOutput([], None, "length", None)) == (TurnKind.INVALID, None)
    assert classify_action("<answer>x</answer>", GenOutput([], None, "stop", "</answer>"))[0] == TurnKind.ANSWER


def test_proceed_flags_take_the_first_half_of_each_group():
    assert proceed_flags([0, 0, 0, 0, 1, 1, 2], 0.5) == [True, True, False, False, True, False, True]


class ScriptedCritic:
    def __init__(self, scores):
        self.scores, self.calls = list(scores), []

    async def ascore_step(self, question, history, action, observation, item=None, turn=-1):
        self.calls.append(action)
        return self.scores.pop(0) if self.scores else 10, "use a better query"


def test_proceed_rewinds_a_bad_step_and_marks_the_refined_tokens(tok):
    agent, engine, _ = loop(tok, lambda text, turn: "<search>bad</search>" if turn == 0 else "<answer>Paris</answer>")
    refine = lambda question, history, rejected, critique: "Refine: " + rejected  # noqa: E731
    # The refiner (the policy engine itself) sees the refiner prompt: script it to write a good search.
    engine.script = lambda text, turn: ("<search>where was Ada born</search>" if text.startswith("Refine")
                                        else "<search>bad</search>" if turn == 0 else "<answer>Paris</answer>")
    critic = ScriptedCritic([1])
    agent.step_hook = ProceedHook(critic, refine, engine, tok, tau=3, max_rewinds=1)
    res = agent.run(prompts(tok, 2), group_id=[0, 0], metas=[{"proceed": True}, {"proceed": False}])
    e, plain = res.episodes
    assert [s.action_text for s in e.steps] == ["<search>where was Ada born</search>", "<answer>Paris</answer>"]
    assert e.steps[0].refined_from == "<search>bad</search>" and e.meta["rewinds"] == 1
    assert e.turns[0].demo == [1] * len(e.turns[0].action_ids) and e.turns[1].demo is None
    assert plain.steps[0].action_text == "<search>bad</search>" and plain.turns[0].demo is None
    b = res.batch
    assert int(b.demo_mask_N.sum()) == len(e.turns[0].action_ids)
    assert critic.calls == ["<search>bad</search>"], "max_rewinds=1 stops the critic after the rewind"
    assert agent.step_hook.stats["rewinds"] == 1


def test_lockstep_refuses_step_hooks(tok):
    agent, engine, _ = loop(tok, search_then_answer, "lockstep")
    agent.step_hook = ProceedHook(ScriptedCritic([]), lambda *a: "", engine, tok)
    with pytest.raises(ValueError, match="rollout.mode=async"):
        agent.run(prompts(tok, 1))


def skewed_script(text, turn):
    """The first trajectory answers at once, the others search first (turn-skewed)."""
    return "<answer>Paris</answer>" if turn or "first" in text else \
        "<think>find the city</think><search>where was Ada born</search>"


def test_rollout_timing_shows_retrieval_overlapping_generation(tok):
    import time

    class Slow(ScriptedEngine):
        async def agenerate(self, prompt, params):  # the first trajectory writes a long answer
            long = "first" in self.tokenizer.decode(prompt)
            await asyncio.sleep(0.12 if long else 0.02)
            return self._one(prompt, params)

        def generate(self, prompts, params):
            time.sleep(0.02)
            return super().generate(prompts, params)

    def slow_search(queries):
        time.sleep(0.05)
        return FakeSearcher(tok)(queries)

    script = skewed_script
    ps = [tok("first question", add_special_tokens=False)["input_ids"]] + prompts(tok, 3)
    lim = AgentLimits(max_turns=4, max_action_tokens=64, max_obs_tokens=200, max_response_tokens=1000)
    stats = {}
    for mode in ("async", "lockstep"):
        agent = AgentLoop(Slow(tok, script), slow_search, lim, SamplingParams(max_tokens=64), mode=mode)
        stats[mode] = agent.run(ps).stats
    a, ls = stats["async"], stats["lockstep"]
    # async: the first trajectory's long answer decodes while the other three wait for their search
    assert a["time/rollout/overlap"] > 0.03 and ls["time/rollout/overlap"] == 0.0
    for s in (a, ls):
        assert s["time/rollout/retrieving"] >= 0.045 and s["time/rollout/generating"] >= 0.035
        assert s["time/rollout/generating"] + s["time/rollout/retrieving"] - s["time/rollout/overlap"] \
            <= s["rollout_s"] + 1e-3
        # three of four trajectories each waited for one search
        assert 0.75 * 0.045 <= s["time/rollout/retrieval_wait_per_traj"] <= s["rollout_s"]


def test_a_searcher_session_is_open_for_the_whole_rollout_even_without_prompts(tok):
    events = []
    agent, _, searcher = loop(tok, search_then_answer)

    class Session:
        def __enter__(self):
            events.append("open")

        def __exit__(self, *exc):
            events.append("close")

    def search(queries):
        events.append("search")
        return searcher(queries)

    search.session = Session
    agent.searcher = search
    agent.run(prompts(tok, 2))
    agent.run([])
    assert events[0] == "open" and events[-3:] == ["close", "open", "close"] and "search" in events[1:-3]


def test_search_r1_turns_generate_past_the_tag_and_are_cut_after_it(tok):
    """rollout.stop_at_tags=false (configs/searchr1_design.yaml): no stop strings; the action keeps its tokens up to
    the first </search>, else the first </answer> (Search-R1's _postprocess_responses prefers </search>)."""
    def rambling(text, turn):
        return ("<think>find the city</think><search>where was Ada born</search> I think so. <answer>Paris</answer>"
                if turn == 0 else "<answer>Paris</answer> I think so. Fake <information>x")

    for mode in ("async", "lockstep"):
        agent, _, _ = loop(tok, rambling, mode, stop_at_tags=False, max_action_tokens=200)
        res = agent.run(prompts(tok, 2), group_id=[0, 0])
        res.batch.validate()
        assert res.batch.seg_kind_S.tolist() == [TurnKind.SEARCH, TurnKind.ANSWER] * 2, mode
        ep = res.episodes[0]
        first, last = (tok.decode(t.action_ids, skip_special_tokens=False) for t in ep.turns)
        assert first.endswith("</search>") and "Paris" not in first and ep.steps[0].query == "where was Ada born"
        assert last.endswith("</answer>") and "Fake" not in last
        assert len(ep.logprobs) == sum(len(t.action_ids) + len(t.obs_ids) for t in ep.turns)  # cut with the tokens
    from fastcredit.rollout.agent import Episode

    e = Episode([1, 2], tok, AgentLimits(stop_at_tags=False), SamplingParams(max_tokens=8), [3])
    assert e.next_request().stop == [] and Episode([1, 2], tok, AgentLimits(), SamplingParams(max_tokens=8),
                                                   [3]).next_request().stop == ["</search>", "</answer>"]


def test_cut_at_first_tag_prefers_search_and_keeps_untagged_actions_whole(tok):
    from fastcredit.rollout.actions import cut_at_first_tag

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    both = ids("<answer>Paris</answer> I think so. <search>where was Ada born</search> more")
    kept, tagged = cut_at_first_tag(both, tok)
    assert tagged and tok.decode(both[:kept], skip_special_tokens=False).endswith("</search>")
    assert not tok.decode(both[:kept - 1], skip_special_tokens=False).endswith("</search>")
    plain = ids("I think so. Fake <information>x")
    assert cut_at_first_tag(plain, tok) == (len(plain), False)


def test_every_turn_records_the_version_of_the_weights_that_wrote_it(tok):
    """Turns carry the engine's weights_version (seg_version_S); a ProCeed refinement (the critic's text, no
    version of its own) belongs to the rollout of the turn it replaces."""
    agent, engine, _ = loop(tok, search_then_answer)
    engine.version = 7  # the weights it samples with
    assert agent.run(prompts(tok, 2), group_id=[0, 0]).batch.seg_version_S.tolist() == [7, 7, 7, 7]
    engine.script = lambda text, turn: ("<search>where was Ada born</search>" if text.startswith("Refine")
                                        else "<search>bad</search>" if turn == 0 else "<answer>Paris</answer>")
    refine = lambda question, history, rejected, critique: "Refine: " + rejected  # noqa: E731
    refiner = ScriptedEngine(tok, engine.script)  # reports no version, as proceed.py's refined outputs
    agent.step_hook = ProceedHook(ScriptedCritic([1]), refine, refiner, tok, tau=3, max_rewinds=1)
    res = agent.run(prompts(tok, 1), group_id=[0], metas=[{"proceed": True}])
    assert res.episodes[0].meta["rewinds"] == 1 and res.batch.seg_version_S.tolist() == [7, 7]
