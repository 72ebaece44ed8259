"""One OpenMP thread team a process: the asynchronous rollout's torch work runs on the caller's thread on a CPU,
and no thread of a rollout outlives it (fastcredit.runtime.threads).

The mechanism is asserted, not a time: which threads ran the engine's batches and the retriever's searches, and
the process's OS threads (OpenMP workers included) before and after a rollout. On the code before issue 51 the
engine's worker thread (and, once it ran a parallel op, its OpenMP worker) outlived every rollout.
"""
import threading

import pytest
import torch

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.retrieval.observation import format_observation
from fastcredit.rollout.agent import AgentLimits, AgentLoop
from fastcredit.rollout.build import rollout_mode
from fastcredit.rollout.engines.base import SamplingParams
from fastcredit.rollout.engines.hf import HFEngine
from fastcredit.runtime.threads import CallerExecutor, process_threads, python_threads, rollout_executor

TEXTS = ["<think>find the city</think><search>where was Ada born</search>", "<answer>Paris</answer>",
         format_observation(['"Ada"\nAda was born in Paris.']), "Question: where was Ada born?"]


@pytest.fixture
def two_threads():
    """Two intra-op threads for the test (the suite's workers run one), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(TEXTS * 20, vocab_size=400)


def tiny_engine(tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return HFEngine(Qwen2ForCausalLM(cfg), tok, "cpu", max_batch=4, batch_timeout_ms=1.0)


class Recorded:
    """Wraps a callable and records the thread of every call."""

    def __init__(self, fn):
        self.fn, self.threads = fn, []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread())
        return self.fn(*args, **kwargs)


def cpu_searcher(tok):
    w = torch.randn(128, 6000)
    obs = tok(format_observation(['"Ada"\nAda was born in Paris.']), add_special_tokens=False)["input_ids"]

    def search(queries):
        torch.log_softmax(torch.randn(len(queries) * 64, 128) @ w, -1)  # large enough to run in parallel
        return [(list(obs), ["doc-1"]) for _ in queries]

    recorded = Recorded(search)
    recorded.torch_device = torch.device("cpu")  # an in-process retriever on the host (retriever_searcher sets it)
    return recorded


def test_an_async_rollout_on_a_cpu_runs_on_the_callers_thread_and_leaves_no_thread(tok, two_threads):
    engine = tiny_engine(tok)
    engine.generate = Recorded(engine.generate)
    searcher = cpu_searcher(tok)
    limits = AgentLimits(max_turns=3, max_action_tokens=8, max_obs_tokens=64, max_response_tokens=200)
    agent = AgentLoop(engine, searcher, limits, SamplingParams(max_tokens=8, stop=["</search>", "</answer>"]),
                      mode="async", retrieval_timeout_ms=1.0)
    torch.log_softmax(torch.randn(256, 128) @ torch.randn(128, 6000), -1)  # the main thread's team, as training's
    before = sorted(process_threads() or [])
    prompt = tok("Question: where was Ada born?", add_special_tokens=False)["input_ids"]
    result = agent.run([prompt] * 8)
    assert len(result.episodes) == 8 and len(engine.generate.threads) >= 2
    assert set(engine.generate.threads) == {threading.current_thread()}
    assert set(searcher.threads) <= {threading.current_thread()}
    assert not [n for n in python_threads() if n.startswith(("engine", "retrieval"))]
    if process_threads() is not None:
        assert sorted(process_threads()) == before  # no other OpenMP team, no worker left


def test_a_gpu_engines_worker_thread_ends_with_the_rollout(monkeypatch):
    """On a GPU the engine's batches run in a thread bound to its device; end_rollout ends that thread."""
    import asyncio

    from fastcredit.rollout.engines.base import Engine, GenOutput

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)

    class GPUEngine(Engine):
        device = torch.device("cuda", 1)

        def generate(self, prompts, params):
            return [GenOutput([1], None, "stop", threading.current_thread().name) for _ in prompts]

        def update_weights(self, named_tensors):
            pass

    engine = GPUEngine()
    out = asyncio.run(engine.agenerate([1], SamplingParams(max_tokens=1)))
    assert out.stop_reason.startswith("engine") and out.stop_reason in python_threads()
    engine.end_rollout()
    assert out.stop_reason not in python_threads()
    out2 = asyncio.run(engine.agenerate([1], SamplingParams(max_tokens=1)))  # a new rollout: a new worker
    engine.end_rollout()
    assert out2.stop_reason.startswith("engine") and out2.stop_reason not in python_threads()


def test_executors_by_device():
    assert isinstance(rollout_executor("cpu", "x"), CallerExecutor)
    ex = CallerExecutor()
    assert ex.submit(threading.current_thread).result() is threading.current_thread()
    assert isinstance(ex.submit(lambda: 1 / 0).exception(), ZeroDivisionError)
    ex.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(len, [])


class _Steps:
    """vLLM's LLMEngine as the step driver uses it: a request finishes at its first step; records the step's
    thread."""

    def __init__(self):
        self.requests, self.threads = [], []

    def add_request(self, rid, prompt, params):
        self.requests.append(rid)

    def abort_request(self, rids):
        pass

    def step(self):
        self.threads.append(threading.current_thread())
        outs = []
        while self.requests:
            class Out:
                finished, request_id, outputs = True, self.requests.pop(), ["done"]
            outs.append(Out())
        return outs


def test_vllm_step_loop_drives_in_the_caller_and_its_thread_ends_when_released():
    import concurrent.futures

    from fastcredit.rollout.engines.steploop import StepLoop

    steps = _Steps()
    loop = StepLoop(steps, render=lambda p: p, params=lambda p: p, convert=lambda o, p, version: o)
    futs = [concurrent.futures.Future() for _ in range(3)]
    for f in futs:
        loop.submit([1], "p", lambda res, err, f=f: f.set_result(res), start=False)
    loop.drive(lambda: all(f.done() for f in futs))  # a blocking generate: the caller steps
    assert [f.result() for f in futs] == ["done"] * 3 and set(steps.threads) == {threading.current_thread()}
    assert "vllm-steps" not in python_threads()
    done = threading.Event()
    loop.submit([1], "p", lambda res, err: done.set())  # an asynchronous caller: the driver thread
    assert done.wait(10) and steps.threads[-1].name == "vllm-steps" and "vllm-steps" in python_threads()
    loop.release()
    assert "vllm-steps" not in python_threads()
    again = threading.Event()
    loop.submit([1], "p", lambda res, err: again.set())  # the next rollout starts a new one
    assert again.wait(10)
    loop.release()
    loop.close()
    assert "vllm-steps" not in python_threads()


def test_rollout_mode_auto_follows_the_engine():
    class Continuous:
        batches_in_flight = True

    class PerCall:
        batches_in_flight = False

    assert rollout_mode("auto", Continuous())[0] == "async"
    mode, why = rollout_mode("auto", PerCall())
    assert mode == "lockstep" and "nothing joins" in why
    assert rollout_mode("auto", PerCall(), hook=object())[0] == "async"  # ProCeed's rewinds
    assert rollout_mode("async", PerCall()) == ("async", "set by rollout.mode")
    assert rollout_mode("lockstep", Continuous())[0] == "lockstep"
