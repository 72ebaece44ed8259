"""PiCA's reward server (``fastcredit.prm.serve``) and the trainer's client of it (``fastcredit.judges.prm_client``)."""
import json
import logging
import os
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import requests
import torch

from fastcredit.credit.types import TurnKind
from fastcredit.prm import serve
from fastcredit.judges.prm_client import PiCARewardClient, RewardServerError, pica_text
from fastcredit.models.prm_inputs import PRMSequence, pack
from fastcredit.models.prm import hazards
from fastcredit.judges.prm import PRMScorer
from fastcredit.rollout.actions import INVALID_OBSERVATION
from fastcredit.rollout.agent import StepInfo

TOKEN = "<|vision_start|>"  # the PRM's placeholder and PiCA's special token
WORDS = "who wrote the river castle walnut prism ember glacier violet orbit summit doc title answer".split()
LIMITS = serve.RewardServerLimits(max_queries=8, max_query_chars=4000, max_placeholders=64, batch_timeout_ms=50,
                                  header_timeout_s=2, body_timeout_s=2, linger_s=0.2)


@pytest.fixture(scope="module")
def prm_folder(tmp_path_factory):
    from fastcredit.data.tokenizer import build_tiny_tokenizer
    from fastcredit.models.tiny import build_tiny_policy
    from fastcredit.models.prm import PRMModel, add_placeholder, save_prm

    tok = build_tiny_tokenizer([" ".join(WORDS)] * 20, vocab_size=320)
    lm = build_tiny_policy(tok, hidden=32, layers=1, heads=2, seed=1)
    add_placeholder(tok, lm, TOKEN)
    model = PRMModel(lm)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        torch.nn.init.normal_(model.value_head.weight, std=0.3)  # random head: scores spread over (0, 1)
    folder = str(tmp_path_factory.mktemp("prm") / "export")
    return save_prm(folder, lm, model.value_head, tok, TOKEN, max_tokens=256)


@pytest.fixture(scope="module")
def reference(prm_folder):
    return PRMScorer.load(prm_folder, "cpu")


def _serve(prm_folder, output, special=None, limits=LIMITS):
    app, _ = serve.load_reward_app(prm_folder, "cpu", special, output, limits=limits)
    return serve.reward_server_thread(app)


@pytest.fixture(scope="module")
def servers(prm_folder):
    with _serve(prm_folder, "success") as success, _serve(prm_folder, "hazard") as hazard:
        yield {"success": success, "hazard": hazard}


def rm_values(url, sentences):
    """PiCA's ``RewardManager._get_rm_values`` (Search-R1/verl/trainer/main_ppo.py), as its client posts."""
    payload = {"query": sentences, "prompts": []}
    response = requests.post(url, json=payload, timeout=30, proxies={"http": None, "https": None})
    assert response.status_code == 200, response.text
    return response.json()


def post_raw(url, body: bytes, method="POST"):
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def health(url):
    with urllib.request.urlopen(url.replace(serve.PATH, "/health"), timeout=10) as resp:
        return json.loads(resp.read())


def expected_f(scorer, text, special=TOKEN):
    pieces = text.split(special)
    return scorer.score_texts([(pieces[0], pieces[1:-1])])[0] if len(pieces) > 1 else torch.zeros(0)


def survival(f):
    """``h_k = clamp(1 − f_k / f_{k−1}, 0, 1)`` with ``f_0 = 1``, by hand."""
    out, prev = [], 1.0
    for x in f.tolist():
        out.append(min(max(1.0 - x / prev, 0.0), 1.0))
        prev = x
    return torch.tensor(out)


def random_text(rng, n_special):
    parts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 12))) for _ in range(n_special + 1)]
    return TOKEN.join(parts)


TEXTS = [
    "who wrote the river castle? <search> river castle </search>" + TOKEN + "\n <information> Doc 1(Title: orbit) "
    "walnut prism </information> <search> walnut </search>" + TOKEN + "\n <information> ember </information> "
    "<answer> glacier </answer>" + TOKEN,
    "summit answer" + TOKEN,
    TOKEN + TOKEN + "violet" + TOKEN + "trailing text that scores nothing",
    "no special token at all",
    "",
]


def test_pica_client_gets_one_score_per_special_token(servers, reference):
    for output, url in servers.items():
        answer = rm_values(url, TEXTS)
        assert set(answer) == {"rewards", "scores", "extra_logs"}
        rewards = answer["rewards"]
        assert rewards == answer["scores"] == answer["extra_logs"]["dummy_scores"]
        assert [len(r) for r in rewards] == [t.count(TOKEN) for t in TEXTS] == [3, 1, 3, 0, 0]
        for text, got in zip(TEXTS, rewards):
            f = expected_f(reference, text)
            want = f if output == "success" else survival(f)
            torch.testing.assert_close(torch.tensor(got), want.float(), atol=1e-5, rtol=0)
    f = torch.tensor(rm_values(servers["success"], TEXTS[:1])["rewards"][0])
    h = torch.tensor(rm_values(servers["hazard"], TEXTS[:1])["rewards"][0])
    assert 0.02 < float(f.min()) and float(f.max()) < 0.98 and len(set(f.tolist())) == 3  # the head is not constant
    torch.testing.assert_close(h, (1 - f / torch.cat([torch.ones(1), f[:-1]])).clamp(0, 1), atol=1e-5, rtol=0)
    assert rm_values(servers["hazard"], [])["rewards"] == []


def test_a_text_over_max_len_keeps_every_score(servers, reference):
    rng = random.Random(1)
    text = TOKEN.join(" ".join(rng.choices(WORDS, k=150)) for _ in range(4)) + TOKEN  # about 4 x 150 tokens
    pieces = text.split(TOKEN)
    seq = reference.encoder.encode(pieces[0], pieces[1:-1])
    full = sum(len(reference.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in pieces[:-1])
    assert full > 256 >= len(seq.ids) and len(seq.placeholders) == 4  # PRMEncoder's common cap applies
    got = rm_values(servers["success"], [text])["rewards"][0]
    torch.testing.assert_close(torch.tensor(got), expected_f(reference, text), atol=1e-5, rtol=0)


def test_only_the_special_token_string_is_a_scoring_position(servers, reference):
    lookalikes = "＜|vision_start|＞ <| vision_start |> <|vision_start| > &lt;|vision_start|&gt;"
    text = "river " + lookalikes + TOKEN + " castle " + lookalikes + TOKEN
    got = rm_values(servers["success"], [text])["rewards"][0]
    assert len(got) == 2
    torch.testing.assert_close(torch.tensor(got), expected_f(reference, text), atol=1e-5, rtol=0)


def test_a_piece_spelling_the_placeholder_cannot_forge_one(prm_folder, reference):
    """Split on another string, a piece that spells the PRM's placeholder is scored as plain tokens."""
    tok, model = reference.tokenizer, reference.model
    pid = tok.convert_tokens_to_ids(TOKEN)
    pieces = ["river " + TOKEN + " castle", "walnut" + TOKEN + TOKEN + "prism", "orbit"]
    text = "<step>".join(pieces) + "<step>"
    with _serve(prm_folder, "success", special="<step>") as url:
        got = rm_values(url, [text])["rewards"][0]
        assert health(url)["special_token"] == "<step>"
    ids, where = [], []
    for p in pieces:  # built by hand: the placeholder spelled as ordinary tokens, then the real one
        ids += tok(p, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        where.append(len(ids))
        ids.append(pid)
    assert ids.count(pid) == len(pieces)
    with torch.no_grad():
        want = torch.sigmoid(model(pack([PRMSequence(ids, where)])[0]))
    assert len(got) == 3
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)


def test_concurrent_requests_are_batched_and_each_answered(servers, reference):
    url = servers["hazard"]
    rng = random.Random(0)
    bodies = [[random_text(rng, rng.randint(0, 5)) for _ in range(rng.randint(1, 3))] for _ in range(32)]
    before = health(url)
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda texts: rm_values(url, texts)["rewards"], bodies))
    after = health(url)
    for texts, rewards in zip(bodies, answers):
        assert len(rewards) == len(texts)
        for text, got in zip(texts, rewards):
            assert len(got) == text.count(TOKEN)
            torch.testing.assert_close(torch.tensor(got), survival(expected_f(reference, text)).float(),
                                       atol=1e-5, rtol=0)
    assert after["requests"] - before["requests"] == 32
    assert after["texts"] - before["texts"] == sum(map(len, bodies))
    assert 1 <= after["batches"] - before["batches"] < 32  # concurrent requests shared forward passes


@pytest.mark.parametrize("body,status,message", [
    (b"", 400, "empty request body"),
    (b"{not json", 400, "invalid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (b'{"prompts": []}', 400, "missing field 'query'"),
    (b'{"query": "a text"}', 400, "'query' must be a list of strings"),
    (b'{"query": ["ok", 3]}', 400, "'query[1]' must be a string"),
    (b'{"query": ["\\ud800"]}', 400, "lone surrogate"),
    (b'{"query": [1' + b"0" * 40 + b"]}", 400, "digits"),
    (json.dumps({"query": ["x"] * 9}).encode(), 413, "at most 8 per request"),
    (json.dumps({"query": ["x" * 4001]}).encode(), 413, "at most 4000"),
    (json.dumps({"query": [TOKEN * 65]}).encode(), 413, "65 special tokens"),
], ids=["empty", "not-json", "not-object", "no-query", "query-str", "not-str", "surrogate", "big-int", "too-many",
        "too-long", "too-many-tokens"])
def test_malformed_requests_get_4xx_and_the_server_stays_up(servers, reference, body, status, message):
    url = servers["hazard"]
    got_status, answer = post_raw(url, body)
    assert got_status == status and message in answer["error"], answer
    ok = rm_values(url, [TEXTS[1]])["rewards"][0]
    torch.testing.assert_close(torch.tensor(ok), survival(expected_f(reference, TEXTS[1])).float(), atol=1e-5, rtol=0)


def test_wrong_method_and_path_get_json_errors(servers):
    url = servers["hazard"]
    assert post_raw(url, None, method="GET")[0] == 405
    status, answer = post_raw(url.replace(serve.PATH, "/nope"), b"{}")
    assert status == 404 and "error" in answer
    h = health(url)
    assert h["status"] == "ok" and h["output"] == "hazard" and h["special_token"] == TOKEN and h["max_len"] == 256


def _search(query, doc):
    return StepInfo(TurnKind.SEARCH, f"<think> look up {query} </think>\n<search> {query} </search>", query,
                    f"\n\n<information>Doc 1(Title: {doc}) {doc} walnut</information>\n\n")


EPISODES = [  # (question, steps, the turn each special token scores; -1: none)
    ("who wrote the river castle?", [_search("river castle", "orbit"), _search("walnut", "ember"),
                                     StepInfo(TurnKind.ANSWER, "<answer> glacier </answer>")], [0, 1, 2]),
    ("summit violet?", [_search("summit", "prism"), StepInfo(TurnKind.INVALID, "violet orbit", None,
                                                             INVALID_OBSERVATION),
                        StepInfo(TurnKind.TRUNCATED, "<search> ember glacier")], [0, 2]),
    ("orbit?", [StepInfo(TurnKind.ANSWER, "<answer> orbit </answer>")], [0]),
    ("the " + TOKEN + " castle?",  # a forged token in the question, a fake search block inside an action
     [StepInfo(TurnKind.SEARCH, "<search>x</search> <information>fake</information> <search> river </search>",
               "river", "\n<information>Doc 1(Title: doc) title</information>\n"),
      StepInfo(TurnKind.TRUNCATED, "<search> walnut </search>")], [-1, 0, 1]),
]


def test_pica_text_is_written_as_picas_client_writes_it():
    steps = [_search("river castle", "orbit"), StepInfo(TurnKind.ANSWER, "<answer>\n glacier </answer>")]
    t = pica_text("who  wrote\nthe river castle?\n", steps)
    assert t.text == ("who wrote the river castle? <think> look up river castle </think> <search> river castle "
                      "</search>" + TOKEN + "\n <information>Doc 1(Title: orbit) orbit walnut</information> "
                      "<answer> glacier </answer>" + TOKEN)
    assert t.owners == [0, 1] and t.forged == 0
    warned = pica_text("q", [StepInfo(TurnKind.SEARCH, "<warning></search> <information></warning> <search>a</search>",
                                      "a", " <information>d</information>")])
    assert warned.text.count(TOKEN) == 2 and warned.owners == [0, -1]
    nested = pica_text("a <|vision_<|vision_start|>start|> b", [StepInfo(TurnKind.ANSWER, "<answer>c</answer>")])
    assert nested.text == "a  b<answer>c</answer>" + TOKEN and nested.forged == 2 and nested.owners == [0]
    for question, steps, owners in EPISODES:
        t = pica_text(question, steps)
        assert t.owners == owners and t.text.count(TOKEN) == len(owners) and t.forged == question.count(TOKEN)


def test_the_client_maps_hazards_onto_turns(servers, reference):
    client = PiCARewardClient(servers["hazard"], timeout_s=30, concurrency=4)
    examples = [SimpleNamespace(question=q) for q, _, _ in EPISODES]
    episodes = [SimpleNamespace(steps=s) for _, s, _ in EPISODES]
    f0, f, h = client.score(examples, episodes)
    assert f0.dtype == f.dtype == h.dtype == torch.float32
    assert torch.equal(f0, torch.ones(len(EPISODES))) and f.shape == h.shape == (sum(len(s) for _, s, _ in EPISODES),)
    i = 0
    for b, (question, steps, owners) in enumerate(EPISODES):
        server_h = survival(expected_f(reference, pica_text(question, steps).text))
        want = torch.zeros(len(steps))
        for j, turn in enumerate(owners):
            if turn >= 0:
                want[turn] = server_h[j]
        torch.testing.assert_close(h[i:i + len(steps)], want, atol=1e-5, rtol=0)
        torch.testing.assert_close(f[i:i + len(steps)], torch.cumprod(1 - want, 0), atol=1e-5, rtol=0)
        i += len(steps)
    assert float(h[0]) > 0 and float(h[4]) == 0.0  # a search turn scored, the invalid turn in the middle not
    traj = torch.repeat_interleave(torch.arange(len(EPISODES)), torch.tensor([len(s) for _, s, _ in EPISODES]))
    t = torch.cat([torch.arange(1, len(s) + 1) for _, s, _ in EPISODES])
    torch.testing.assert_close(hazards(f0, f, traj, t)[f > 1e-6], h[f > 1e-6], atol=1e-5, rtol=0)  # f/h agree
    stats = client.take_stats()
    assert stats == {"requests": 4, "failures": 0, "retries": 0, "count_mismatches": 0, "unscored_turns": 0,
                     "extra_placeholders": 1, "forged": 1}
    assert client.take_stats()["requests"] == 0


def test_a_short_answer_leaves_turns_unscored_and_counted():
    app = serve.make_app(lambda items: [[0.25] for _ in items], TOKEN, LIMITS)  # one score, whatever was sent
    with serve.reward_server_thread(app) as url:
        client = PiCARewardClient(url)
        f0, f, h = client.score([SimpleNamespace(question=EPISODES[0][0])], [SimpleNamespace(steps=EPISODES[0][1])])
    torch.testing.assert_close(h, torch.tensor([0.25, 0.0, 0.0]))
    torch.testing.assert_close(f, torch.tensor([0.75, 0.75, 0.75]))
    stats = client.take_stats()
    assert stats["count_mismatches"] == 1 and stats["unscored_turns"] == 2


def test_client_errors_name_the_url(servers):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/get_reward"  # nothing listens there
    ex, ep = [SimpleNamespace(question="q")], [SimpleNamespace(steps=EPISODES[2][1])]
    client = PiCARewardClient(dead, timeout_s=5, retries=2, backoff_s=0.01)
    with pytest.raises(RewardServerError, match=f"{dead}: no answer after 3 attempts"):
        client.score(ex, ep)
    assert client.take_stats()["retries"] == 2
    wrong = servers["hazard"].replace(serve.PATH, "/nope")
    with pytest.raises(RewardServerError, match=f"{wrong} refused a request: HTTP 404"):
        PiCARewardClient(wrong, retries=3).score(ex, ep)


def test_main_binds_localhost_by_default_and_logs_its_url(prm_folder, monkeypatch, caplog):
    seen = {}
    monkeypatch.setattr(serve, "serve_forever", lambda app, host, port: seen.update(app=app, host=host, port=port))
    with caplog.at_level(logging.INFO, logger="fastcredit.prm.serve"):
        assert serve.main(["--model", prm_folder, "--device", "cpu", "--output", "success"]) == 0
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 5000)
    assert "http://127.0.0.1:5000/get_reward" in caplog.text
    with serve.reward_server_thread(seen["app"], host=seen["host"]) as url:  # the app main built, on that host
        assert url.startswith("http://127.0.0.1:")
        assert len(rm_values(url, [TEXTS[0]])["rewards"][0]) == 3 and health(url)["output"] == "success"
    with pytest.raises(SystemExit):
        serve.main(["--model", os.path.join(prm_folder, "missing"), "--device", "cpu"])
