"""Which executor and device vLLM would give each rank's engine under torchrun (no GPU needed).

The engine's ``vllm.LLM`` keyword arguments (``engine_kwargs``) are turned into vLLM's own
configuration and executor choice, as ``LLM`` does. Under torchrun (rank 3 of 8), vLLM's
default ``uni`` executor takes its local rank from ``DeviceConfig.device``, a bare ``cuda``:
local rank 0, so every rank's engine would start on ``cuda:0``; ``external_launcher`` takes
``LOCAL_RANK``, and vLLM's GPU worker then runs on ``cuda:<LOCAL_RANK>`` (``gpu_worker.init_device``).
"""
import pytest
import torch
import torch.distributed as dist

from fastcredit.rollout.engines import vllm as fv

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from fastcredit.data.tokenizer import build_tiny_tokenizer
    from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy

    tok = build_tiny_tokenizer(["<search>where is the river</search> <answer>Paris</answer>"] * 20, vocab_size=300)
    return save_tiny_policy(build_tiny_policy(tok, hidden=32, layers=2, heads=2, seed=1), tok,
                            str(tmp_path_factory.mktemp("vllm_device") / "policy"))


def executor_for(folder: str, device: torch.device):
    """(executor class, (init method, rank, local rank) it passes its worker), as vllm.LLM would build them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.abstract import Executor

    kw = fv.engine_kwargs(folder, folder, device, load_format="dummy")
    config = EngineArgs(**kw).create_engine_config()
    cls = Executor.get_class(config)
    holder = type("Holder", (), {"vllm_config": config})()
    return cls, cls._distributed_args(holder)


def test_rank3_of_8_gets_the_external_launcher_and_its_local_rank(folder, monkeypatch):
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    for key, value in {"LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "8", fv.IN_PROCESS_ENV: "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    gpu_kw = fv.engine_kwargs(folder, folder, torch.device("cuda", 3))
    assert gpu_kw["distributed_executor_backend"] == "external_launcher" and gpu_kw["enable_sleep_mode"]
    # vLLM's CPU build refuses sleep mode for a CUDA device; the executor choice does not depend on the device
    cls, (init, rank, local_rank) = executor_for(folder, torch.device("cpu"))
    assert cls is ExecutorWithExternalLauncher and (init, rank, local_rank) == ("env://", 3, 3)


def test_the_default_uni_executor_would_put_rank3_on_device_0(folder, monkeypatch):
    """What the engine built before issue 29 got: no executor named, so vLLM picks ``uni`` for a world of 1."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    for key, value in {"LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "1", fv.IN_PROCESS_ENV: "0"}.items():
        monkeypatch.setenv(key, value)
    cls, (_, rank, local_rank) = executor_for(folder, torch.device("cpu"))
    assert cls is UniProcExecutor and (rank, local_rank) == (0, 0)


def test_torchrun_engine_needs_the_process_group_first(folder, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="after the job's process group"):
        fv.engine_kwargs(folder, folder, torch.device("cpu"))


def test_tensor_parallel_engine_is_refused():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="cannot be pickled"):
        fv.engine_kwargs("m", "m", torch.device("cpu"), SimpleNamespace(tensor_parallel=2, enable_prefix_caching=True))


def test_an_inherited_multiprocessing_flag_is_overridden_and_said(monkeypatch):
    said = []
    monkeypatch.setenv(fv.IN_PROCESS_ENV, "1")
    fv.in_process_env(said.append)
    import os

    assert os.environ[fv.IN_PROCESS_ENV] == "0" and "ignored" in said[0]
    said.clear()
    fv.in_process_env(said.append)
    assert said == []
