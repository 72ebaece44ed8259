"""Every thread that touches CUDA binds the rank's device first (a new thread starts on device 0).

No GPU here: ``torch.cuda.set_device`` is replaced by a recorder, so each test sees which
device each thread bound. Each fails on the code before issue 29, whose threads never bound one.
"""
import asyncio
import threading

import pytest
import torch

from fastcredit.runtime import devices


@pytest.fixture
def bound(monkeypatch):
    """thread name -> the device it bound, as torch.cuda.set_device was called."""
    seen = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.__setitem__(threading.current_thread().name,
                                                                             torch.device(d)))
    return seen


def test_helpers_bind_cuda_and_ignore_cpu(bound):
    devices.bind_thread("cpu")
    devices.bind_thread(None)
    assert bound == {}
    pool = devices.device_executor(torch.device("cuda", 5), "pool")
    name = pool.submit(lambda: threading.current_thread().name).result()
    pool.shutdown()
    assert bound == {name: torch.device("cuda", 5)}
    wrapped = devices.on_device("cuda:6", lambda x: (threading.current_thread().name, x))
    name, x = asyncio.run(asyncio.to_thread(wrapped, 1))
    assert x == 1 and bound[name] == torch.device("cuda", 6)
    assert devices.on_device("cpu", len) is len


def test_a_bare_cuda_device_is_the_creators_current_one(bound, monkeypatch):
    """``torch.device("cuda")`` has no index, which set_device refuses (the H100 run's rollout benchmark:
    "Expected a torch.device with a specified index"); the pool binds the device current where it was made."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    pool = devices.device_executor(torch.device("cuda"), "bare")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # a new thread's own current device
    name = pool.submit(lambda: threading.current_thread().name).result()
    pool.shutdown()
    assert bound == {name: torch.device("cuda", 2)}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 4)
    wrapped = devices.on_device("cuda", lambda: threading.current_thread().name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert bound[asyncio.run(asyncio.to_thread(wrapped))] == torch.device("cuda", 4)


class _FakeEngine:
    """vLLM's LLMEngine as the step driver uses it: one request finishing at its first step."""

    def __init__(self):
        self.requests = []

    def add_request(self, rid, prompt, params):
        self.requests.append(rid)

    def abort_request(self, rids):
        pass

    def step(self):
        class Out:
            finished, request_id, outputs = True, self.requests.pop(), ["done"]
        return [Out()]


def test_vllm_step_driver_binds_the_engine_device(bound):
    from fastcredit.rollout.engines.vllm import StepLoop

    loop = StepLoop(_FakeEngine(), render=lambda p: p, params=lambda p: p, convert=lambda o, p, version: o,
                    device=torch.device("cuda", 3))
    got = []
    done = threading.Event()
    loop.submit([1, 2], "params", lambda res, err: (got.append((res, err)), done.set()))
    assert done.wait(10)
    loop.close()
    assert got == [("done", None)] and bound == {"vllm-steps": torch.device("cuda", 3)}


def test_a_request_whose_output_cannot_be_read_fails_alone(bound):
    from fastcredit.rollout.engines.vllm import EngineError, StepLoop

    def convert(o, p, version):
        raise ValueError("bad output")

    loop = StepLoop(_FakeEngine(), render=lambda p: p, params=lambda p: p, convert=convert)
    got = []
    done = threading.Event()
    loop.submit([1, 2], "params", lambda res, err: (got.append((res, err)), done.set()))
    assert done.wait(10)
    loop.close()
    assert got[0][0] is None and isinstance(got[0][1], EngineError) and "bad output" in str(got[0][1])


def test_micro_batcher_thread_takes_its_creators_device(bound, monkeypatch):
    from fastcredit.runtime.batching import MicroBatcher

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)

    async def run():
        batcher = MicroBatcher(lambda items: [threading.current_thread().name for _ in items])
        batcher.start()
        try:
            return (await batcher.submit(["q"]))[0]
        finally:
            await batcher.close()

    name = asyncio.run(run())
    assert bound == {name: torch.device("cuda", 2)}


def test_engine_executor_and_judge_threads_bind_the_engine_device(bound):
    from fastcredit.judges.backends import EngineBackend, JudgeRequest
    from fastcredit.rollout.engines.base import Engine, GenOutput, SamplingParams

    class Engine1(Engine):
        device = torch.device("cuda", 1)
        tokenizer = None

        def generate(self, prompts, params):
            return [GenOutput([threading.current_thread().name], None, "stop", None) for _ in prompts]

        def generate_text(self, prompts, max_tokens, temperatures, seeds=None, **kw):
            return [threading.current_thread().name for _ in prompts]

        def sleep(self, level=1):
            pass

        def wake_up(self, tags=None):
            pass

        def update_weights(self, named_tensors):
            pass

    engine = Engine1()
    try:
        out = asyncio.run(engine.agenerate([1], SamplingParams(max_tokens=1)))
        assert bound[out.token_ids[0]] == torch.device("cuda", 1)
        backend = EngineBackend(engine, temperature=0.0, max_tokens=4)
        names = asyncio.run(backend.complete([JudgeRequest("judge this", "criticsearch")]))
        assert bound[names[0]] == torch.device("cuda", 1)
    finally:  # its worker thread (engine_0) must not outlive the test: tests/runtime/test_threads.py counts threads
        engine.end_rollout()
