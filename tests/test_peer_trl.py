"""TRL's GRPOTrainer as fastcredit's peer (bench/peer_trl*.py, issue 60): its Search-R1 rollout turns and caps are
fastcredit's (token for token against fastcredit's own agent loop), env_mask is 0 on exactly the observations, the
replay trains TRL on the very token ids fastcredit recorded, one real TRL step runs on the tiny policy, and the
settings map onto GRPOConfig (the docs' table is the code's)."""
import collections
import json
import os

import pytest
import torch

pytest.importorskip("trl", reason="the TRL peer needs the trl extra (setup.py: trl==1.16.0)")

from tests.commands import run_main  # noqa: E402

from bench.peer_trl import build, parse, read_steps  # noqa: E402
from bench.peer_trl_rollout import Caps, ReplayRollout, SearchR1Rollout, load_replay  # noqa: E402
from bench.peer_trl_settings import Unmappable, grpo_kwargs, markdown_table, settings  # noqa: E402
from fastcredit.config import load_config  # noqa: E402
from fastcredit.retrieval.observation import format_observation  # noqa: E402
from fastcredit.retrieval.searcher import http_searcher  # noqa: E402
from fastcredit.retrieval.testing import tiny_policy_tokenizer  # noqa: E402
from fastcredit.rollout.actions import INVALID_OBSERVATION  # noqa: E402
from fastcredit.rollout.agent import AgentLimits, AgentLoop  # noqa: E402
from fastcredit.rollout.engines.base import GenOutput, SamplingParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(ROOT, "configs", "debug.yaml")


def script(text: str, turn: int) -> str:
    """The scripted policy: what it writes on turn ``turn`` of the trajectory whose prompt holds its question."""
    q = text.split("Question:", 1)[1].split("\n", 1)[0].strip() if "Question:" in text else ""
    plans = {
        "search twice": ["<search>ada</search>", "<search>ada paris</search>", "<answer>Paris</answer>"],
        "invalid first": ["hmm let me see<|endoftext|>", "<answer>Paris</answer>"],
        "never answers": ["<search>a</search>"] * 9,
        "rambles": ["word " * 40 + "<answer>x</answer>", "<answer>x</answer>"],
        "long reader": ["<search>long</search>"] * 9,
    }
    return plans[q][min(turn, len(plans[q]) - 1)]


class FakeClient:
    """A ``/retrieve`` client's ``retrieve``: fixed passages per query (long ones for the query ``long``)."""

    def __init__(self):
        self.calls = []

    def retrieve(self, queries, topk=3, return_scores=True):
        self.calls.append(list(queries))
        return [[{"document": {"id": f"{q}-{k}", "contents": f'"{q} {k}"\n' + " ".join(["Ada"] * (60 if q == "long"
                                                                                                  else 4))},
                  "score": 1.0} for k in range(topk)] for q in queries]


def turns_seen(tok, text: str) -> int:
    """The observations in a context so far (by their openings: the caps may cut their ends)."""
    return text.count("<information>") + text.count(INVALID_OBSERVATION.strip()[:28])


class ScriptedEngine:
    """fastcredit's engine interface over the script (lockstep: ``generate``)."""

    def __init__(self, tok):
        self.tokenizer = tok

    def generate(self, prompts, params):
        outs = []
        for p, q in zip(prompts, params):
            text = self.tokenizer.decode(p, skip_special_tokens=False)
            ids = self.tokenizer(script(text, turns_seen(self.tokenizer, text)), add_special_tokens=False)["input_ids"]
            stopped = len(ids) <= q.max_tokens
            outs.append(GenOutput(ids[: q.max_tokens], None, "stop" if stopped else "length"))
        return outs


class ScriptedLM(torch.nn.Module):
    """``model.generate`` over the script, as transformers returns it: the left-padded inputs, then each row's new
    tokens up to ``max_new_tokens``, finished rows padded."""

    def __init__(self, tok):
        super().__init__()
        self.tok, self.weight = tok, torch.nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, attention_mask, generation_config, tokenizer):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
            rows.append(self.tok(script(text, turns_seen(self.tok, text)), add_special_tokens=False)["input_ids"]
                        [: generation_config.max_new_tokens])
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [generation_config.pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], 1)


class FakeTrainer:
    """What a rollout_func reads of a GRPOTrainer: its model through the accelerator, and its sampling arguments."""

    def __init__(self, model):
        self.model, self.args = model, type("Args", (), {"temperature": 1.0, "top_p": 1.0, "top_k": 0})()
        self.accelerator = type("Accelerator", (), {"unwrap_model": staticmethod(lambda m: m)})()


QUESTIONS = ["search twice", "invalid first", "never answers", "rambles", "long reader"]
CAPS = Caps(max_turns=3, max_action_tokens=24, max_obs_tokens=64, max_response_tokens=140)


@pytest.fixture(scope="module")
def tok():
    return tiny_policy_tokenizer()


def both_rollouts(tok):
    prompts = {f"Question: {q}\nAnswer:": tok(f"Question: {q}\nAnswer:", add_special_tokens=False)["input_ids"]
               for q in QUESTIONS}
    client = FakeClient()
    trl = SearchR1Rollout(tok, prompts, CAPS, client, topk=2)(list(prompts), FakeTrainer(ScriptedLM(tok)))
    limits = AgentLimits(CAPS.max_turns, CAPS.max_action_tokens, CAPS.max_obs_tokens, CAPS.max_response_tokens)
    agent = AgentLoop(ScriptedEngine(tok), http_searcher(FakeClient(), tok, 2), limits,
                      SamplingParams(max_tokens=CAPS.max_action_tokens), mode="lockstep")
    ours = agent.run(list(prompts.values()))
    return trl, ours, client


def test_the_rollout_takes_fastcredits_turns_and_caps_token_for_token(tok):
    """Searches, an invalid turn, the turn cap, an action past its token cap, an observation past its cap: TRL's
    rollout_func gives every trajectory fastcredit's agent loop's tokens and masks (its HTTP searcher, lockstep)."""
    trl, ours, client = both_rollouts(tok)
    b = ours.batch
    cu = b.cu_seqlens.tolist()
    for i, q in enumerate(QUESTIONS):
        assert trl["completion_ids"][i] == b.tokens_N[cu[i]:cu[i + 1]].tolist(), q
        assert trl["env_mask"][i] == b.action_mask_N[cu[i]:cu[i + 1]].int().tolist(), q
        assert trl["prompt_ids"][i] == ours.prompt_ids[i]
    assert trl["action_texts"][1] == ["hmm let me see<|endoftext|>", "<answer>Paris</answer>"]
    assert client.calls[0] == ["ada", "a", "long"]  # one request a turn, every search of the turn in it
    # the caps bit: the turn cap (3 searches, the last truncated), the action cap ("rambles": 24 tokens), the
    # response cap ("search twice" and "long reader" end at 140 tokens, their last action cut), the observation cap
    assert [len(t) for t in trl["action_texts"]] == [3, 2, 3, 2, 3]
    assert len(tok(trl["action_texts"][3][0], add_special_tokens=False)["input_ids"]) == CAPS.max_action_tokens
    assert [len(c) for c in trl["completion_ids"]][0::4] == [CAPS.max_response_tokens] * 2
    observations = [ids for m, ids in _runs_of(trl, 4) if m == 0]
    assert observations and all(len(ids) == CAPS.max_obs_tokens for ids in observations)


def test_env_mask_is_zero_on_exactly_the_observations(tok):
    """Every run of masked tokens decodes to an observation (Search-R1's information block of the retrieved
    passages, or the corrective message) and every unmasked run to the policy's own actions."""
    trl, _, _ = both_rollouts(tok)
    docs = format_observation([f'"ada {k}"\n' + " ".join(["Ada"] * 4) for k in range(2)])
    obs_ids = tok(docs, add_special_tokens=False)["input_ids"]
    invalid = tok(INVALID_OBSERVATION, add_special_tokens=False)["input_ids"][: CAPS.max_obs_tokens]
    for i, q in enumerate(QUESTIONS):
        runs = _runs_of(trl, i)
        actions = [tok.decode(ids, skip_special_tokens=False) for m, ids in runs if m == 1]
        assert actions == trl["action_texts"][i], q
        for m, ids in runs:
            if m == 0:
                text = tok.decode(ids, skip_special_tokens=False)
                assert ids == invalid or text.startswith("\n\n<information>"), q
    assert obs_ids in [ids for m, ids in _runs_of(trl, 0) if m == 0]
    assert invalid in [ids for m, ids in _runs_of(trl, 1) if m == 0]


def _runs_of(trl, i: int) -> list:
    """Trajectory ``i``'s completion as ``[(mask value, token ids)]``: its runs of equal mask."""
    out = []
    for t, m in zip(trl["completion_ids"][i], trl["env_mask"][i]):
        if not out or out[-1][0] != m:
            out.append((m, []))
        out[-1][1].append(t)
    return out


def test_the_settings_map_onto_grpo_config_and_the_docs_show_them():
    from trl import GRPOConfig

    cfg = load_config([os.path.join(ROOT, "configs", "searchr1_grpo.yaml")])
    rows = settings(cfg, micro_batch=5)
    kwargs = grpo_kwargs(rows)
    args = GRPOConfig(output_dir="unused", use_cpu=True, **kwargs)  # every argument exists and validates
    assert (args.epsilon, args.epsilon_high, args.beta, args.loss_type) == (0.2, 0.2, 0.001, "dapo")
    assert args.entropy_coef == 0.001 and args.use_bias_correction_kl is False and args.num_generations == 5
    assert args.mask_truncated_completions is False and args.num_iterations == 1 and not args.bf16
    assert args.generation_batch_size == 512 * 5 and args.steps_per_generation == 512 * 5 // 5
    assert args.gradient_accumulation_steps == 64 * 5 // 5  # one optimizer step a mini-batch of 64 prompts
    doc = open(os.path.join(ROOT, "docs", "peer-trl.md"), encoding="utf-8").read()
    assert markdown_table(rows) in doc, "docs/peer-trl.md's table is not the code's: print it with " \
                                        "python -m bench.peer_trl --settings configs/searchr1_grpo.yaml"
    for override in ("loss.agg_mode=seq-mean-token-sum", "credit.estimator=criticsearch", "loss.dual_clip=3.0",
                     "credit.dynamic_sampling.enabled=true"):
        with pytest.raises(Unmappable):
            settings(load_config([os.path.join(ROOT, "configs", "searchr1_grpo.yaml")], [override]), 5)


def test_trls_reward_is_the_runs_outcome_reward():
    """The reward function TRL gets scores as fastcredit's run of the same config: ``credit.reward=auto`` resolved
    (CriticSearch's graded reward on the chain world, plain EM on the lookup world), with the run's lambda_f."""
    from bench.peer_trl_rollout import trl_reward

    actions = ["<search> q </search>", "<answer> Paris </answer>"]
    wrong = ["<answer> Rome </answer>"]
    chain = trl_reward(load_config([DEBUG], ["credit.lambda_f=0.3"]))
    assert chain.__name__ == "criticsearch_reward"
    assert chain([None] * 2, [actions, wrong], [["Paris"], ["Paris"]]) == [1.0, 0.3]  # formatted, wrong: lambda_f
    lookup = trl_reward(load_config([DEBUG], ["data.toy.kind=lookup", "rollout.max_turns=5"]))
    assert lookup.__name__ == "em_reward" and lookup([None] * 2, [actions, wrong], [["Paris"], ["Paris"]]) == [1, 0]


# ------------------------------------------------------------------- real steps on the tiny policy (debug world)

SMALL = ["logging.progress=false", "eval.questions=0", "logging.checkpoint_every=0", "optim.weight_decay=0",
         "loss.entropy_coef=0.01"]


@pytest.fixture(scope="module")
def race(tmp_path_factory):
    """The debug config's start policy as an HF folder, and two of fastcredit's steps recorded (frozen)."""
    work = tmp_path_factory.mktemp("race")
    common = [f"data.world_dir={work / 'world'}", *SMALL]
    proc = run_main("bench.race_fastcredit", ["prepare", "--config", DEBUG, "--work", work, *common])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_main("bench.race_fastcredit", ["steps", "--config", DEBUG, "--work", work, "--steps", "2",
                                              "--record", work / "replay", *common, "optim.lr=0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work, common


def test_the_replay_feeds_trl_the_recorded_token_ids(race):
    """Every row TRL's policy trains on (its forwards with gradients) is a recorded prompt + response, each exactly
    as often as recorded; the recorded masks and rewards arrive too. Other prompts are refused."""
    work, common = race
    a = parse(["--config", DEBUG, "--model", str(work / "start"), "--out", str(work / "trl_replay"), "--replay",
               str(work / "replay"), "--steps", "2", *common, "optim.lr=0"])
    trainer, rollout, _ = build(a, load_config([a.config], a.overrides))
    seen = []

    def capture(module, args, kwargs):
        if torch.is_grad_enabled():
            for ids, mask in zip(kwargs["input_ids"].tolist(), kwargs["attention_mask"].tolist()):
                seen.append(tuple(t for t, m in zip(ids, mask) if m))

    trainer.model.register_forward_pre_hook(capture, with_kwargs=True)
    trainer.train()
    steps = load_replay(str(work / "replay"))
    want = collections.Counter(tuple(p + t) for s in steps for p, t in zip(s["prompt_ids"], s["tokens"]))
    assert collections.Counter(seen) == want
    assert sum(len(s["tokens"]) for s in steps) == 2 * 4 * 2  # two steps of 4 prompts x 2 samples
    at_start = type("Trainer", (), {"state": type("State", (), {"global_step": 0})()})()
    with pytest.raises(ValueError, match="not the recorded ones"):
        ReplayRollout(steps, lambda ids: "x")(["y"] * 8, at_start)
    assert ReplayRollout(steps, lambda ids: "x")(["x"] * 8, at_start)["completion_ids"] == steps[0]["tokens"]


def test_trl_runs_one_step_of_its_own_rollout_on_the_tiny_policy_and_resumes(race):
    """One GRPOTrainer step with the Search-R1 rollout_func against a /retrieve server on the world's corpus: the
    step's row names every phase, the trained tokens are the rollout's, and the update moved the weights. Then
    ``--resume`` to two steps: the second step trains from the first one's checkpoint, and the log holds both."""
    from fastcredit.retrieval.retriever import open_retriever
    from fastcredit.retrieval.serve import ServerLimits, ServerThread, make_app, retriever_batch_fn

    work, common = race
    retriever = open_retriever(corpus=str(work / "world" / "corpus.jsonl"), encoder="minilm")
    server = ServerThread(make_app(retriever_batch_fn(retriever), ServerLimits(), {}))
    url = server.start()
    args = ["--config", DEBUG, "--model", work / "start", "--out", work / "trl", "--retrieval-url", url,
            "--save-every", "1", *common]
    try:
        first = run_main("bench.peer_trl", [*args, "--steps", "1"])
        assert first.returncode == 0, first.stderr[-3000:]
        (row,) = read_steps(str(work / "trl"))
        result = json.load(open(work / "trl" / "result.json"))
        resumed = run_main("bench.peer_trl", [*args, "--steps", "2", "--resume"])
    finally:
        server.stop()
    assert row["step"] == 1 and row["trajectories"] == 4 * 2
    assert all(row[k] > 0 for k in ("time/step", "time/rollout", "time/rollout/generating", "time/ref_logprobs",
                                    "time/update", "tokens/trained", "decoded_tokens_per_traj", "engine/steps"))
    assert row["time/rollout"] + row["time/update"] <= row["time/step"]
    start = json.load(open(work / "start" / "digest.json"))["folder"]
    assert result["start_weights"] == start and result["end_weights"] != start
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_steps(str(work / "trl"))] == [1, 2]
    # debug.yaml: 2 mini-batches a step, so TRL's optimizer steps 2 and 4 end steps 1 and 2
    assert {"checkpoint-2", "checkpoint-4"} <= set(os.listdir(work / "trl"))
