"""Which executor vLLM would give each rank's engine under torchrun (no GPU needed), through vLLM's public API.

The engine's ``vllm.LLM`` keyword arguments (``engine_kwargs``) are turned into vLLM's own configuration
(``EngineArgs(**kw).create_engine_config()``) and executor class (``Executor.get_class``), as ``LLM`` does. Under
torchrun (rank 3 of 8) the engine must name ``external_launcher``: that executor joins the job's process group and
runs its worker on ``cuda:<LOCAL_RANK>``, as vLLM documents it for torchrun-launched engines. vLLM's default for a
world of one, ``uni``, takes its local rank from the configured device instead, which names no index (a bare
``cuda``): local rank 0, so every rank's engine would start on ``cuda:0``.
"""
import pytest
import torch
import torch.distributed as dist

from fastcredit.rollout.engines import vllm as fv
from fastcredit.rollout.engines import vllm_compat

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from fastcredit.data.tokenizer import build_tiny_tokenizer
    from fastcredit.models.tiny import build_tiny_policy, save_tiny_policy

    tok = build_tiny_tokenizer(["<search>where is the river</search> <answer>Paris</answer>"] * 20, vocab_size=300)
    return save_tiny_policy(build_tiny_policy(tok, hidden=32, layers=2, heads=2, seed=1), tok,
                            str(tmp_path_factory.mktemp("vllm_device") / "policy"))


def engine_config(folder: str, device: torch.device):
    """``(vLLM's config, the executor class)`` an engine on ``device`` gets, as vllm.LLM would build them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.abstract import Executor

    config = EngineArgs(**fv.engine_kwargs(folder, folder, device, load_format="dummy")).create_engine_config()
    return config, Executor.get_class(config)


def test_rank3_of_8_gets_the_external_launcher(folder, monkeypatch):
    for key, value in {"LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "8", fv.IN_PROCESS_ENV: "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    gpu_kw = fv.engine_kwargs(folder, folder, torch.device("cuda", 3))
    assert gpu_kw["distributed_executor_backend"] == "external_launcher" and gpu_kw["enable_sleep_mode"]
    # vLLM's CPU build refuses sleep mode for a CUDA device; the executor choice does not depend on the device
    config, cls = engine_config(folder, torch.device("cpu"))
    external, _ = vllm_compat.launcher_executors()
    assert cls is external and config.parallel_config.distributed_executor_backend == "external_launcher"
    assert config.parallel_config.world_size == 1  # one engine a rank: no tensor-parallel workers of its own


def test_without_torchrun_vllm_picks_the_uni_executor_whose_device_names_no_rank(folder, monkeypatch):
    """An engine that names no executor: vLLM picks ``uni`` for a world of 1, its device without a rank's index."""
    for key, value in {"LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "1", fv.IN_PROCESS_ENV: "0"}.items():
        monkeypatch.setenv(key, value)
    assert "distributed_executor_backend" not in fv.engine_kwargs(folder, folder, torch.device("cpu"))
    config, cls = engine_config(folder, torch.device("cpu"))
    _, uni = vllm_compat.launcher_executors()
    assert cls is uni and torch.device(config.device_config.device).index is None


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
