"""The run's offload choice (``fastcredit.trainer.memory.offload``) reaches every part that acts on it: the phase
manager, the reference policy's placement, the HF engine's sleep, vLLM's share and the run's log. Colocated on a GPU
a state that moves starts the reference on the host (its passes bring it in); one that stays keeps the reference,
and the HF engine's weights, on the GPU, where a reference left on the host would meet its inputs on the wrong
device."""
import os
import types

import pytest
import torch

from fastcredit.config import ConfigError, load_config
from fastcredit.trainer.memory import MemoryBudgetError
from fastcredit.trainer.memory.offload import decide_offload
from fastcredit.trainer.memory.parts import OffloadChoice

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=0",
         "optim.total_steps=0"]
GIB = 2 ** 30


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")  # made by the first trainer, read by the others


def test_the_state_moves_only_colocated_on_a_gpu_when_the_choice_says_so(monkeypatch):
    from fastcredit.trainer.parts import moves_training_state

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        total_memory=80 * GIB))  # the rank's GPU, as the trainer reads it
    gpu = types.SimpleNamespace(device=torch.device("cuda", 0), world_size=1)
    cpu = types.SimpleNamespace(device=torch.device("cpu"), world_size=1)
    big = ["model.policy=Qwen2.5-7B", "optim.micro_batch_tokens=65536"]  # kept, the update would not fit
    for items, info, moves in (([], gpu, False), (big, gpu, True), (["distributed.offload_state=true"], gpu, True),
                               (["distributed.offload_state=false", *big], gpu, False),
                               (["distributed.colocate=false", "distributed.offload_state=true"], gpu, False),
                               (["distributed.offload_state=true"], cpu, False)):
        assert moves_training_state(load_config(None, items), info) is moves, (items, info.device)
    given = OffloadChoice(True, "given")
    assert moves_training_state(load_config(None, []), cpu, given) is True  # the run's one choice, when passed


@pytest.mark.parametrize("setting", ["auto", "true"])
def test_the_choice_reaches_the_phase_manager_the_reference_and_the_log(monkeypatch, world, setting, tmp_path):
    """A CPU run standing in for one on an 80 GiB GPU (the choice made as there): the phase manager, the reference's
    placement and the HF engine's sleep level follow the one choice, printed at start and in the first metrics."""
    import fastcredit.distributed.colocate as colocate
    import fastcredit.trainer.memory.offload as offload
    from fastcredit.distributed.fsdp import FrozenModel
    from fastcredit.distributed.process_group import DistInfo
    from fastcredit.trainer.build import colocated_trainer
    from fastcredit.trainer.run import Run

    made, offloads, said, asked = [], [], [], []

    class Recorded(colocate.PhaseManager):
        def __init__(self, *args, **kwargs):
            made.append((kwargs.get("move_state"), args[4]))  # policy_sleep_level is the fifth
            super().__init__(*args, **kwargs)

    def on_an_80gib_gpu(cfg, device, gpus):
        asked.append(gpus)
        return decide_offload(cfg, 80.0, gpus)

    monkeypatch.setattr(colocate, "PhaseManager", Recorded)
    monkeypatch.setattr(offload, "local_offload", on_an_80gib_gpu)
    monkeypatch.setattr(FrozenModel, "offload", lambda self: offloads.append(self))
    monkeypatch.setattr(Run, "say", lambda self, text: said.append(text))
    cfg = load_config(os.path.join(ROOT, "configs", "debug.yaml"),
                      [f"data.world_dir={world}", f"logging.output_dir={tmp_path / 'run'}", *SMALL,
                       "loss.kl_coef=0.001", f"distributed.offload_state={setting}"])
    trainer = colocated_trainer(cfg, DistInfo())
    try:
        moves = setting == "true"
        assert trainer.parts.training.ref is not None and asked == [1]  # decided once
        assert made == [(moves, 2 if moves else 0)] and len(offloads) == (1 if moves else 0)
        line = f"distributed.offload_state={setting}: the training state " + (
            "moves to the host while the engines work (as set)" if moves else "stays on the GPU (the plan with it kept")
        assert any(text.startswith(line) for text in said), said
        assert trainer.parts.memory["offload_state/moves"] == float(moves)
    finally:
        trainer.logger.close()


class Engine:
    """A rollout engine that records what the phase manager asks of it."""

    def __init__(self, log: list):
        self.log, self.weights_version = log, 0

    def sleep(self, level):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake", tags))


class State:
    def __init__(self, log: list):
        self.log = log

    def offload(self):
        self.log.append("offload")

    def reload(self):
        self.log.append("reload")


@pytest.mark.parametrize("level", [0, 2])
def test_a_kept_hf_engine_is_never_put_to_sleep_only_its_cache_emptied(monkeypatch, level):
    """Level 0 (the HF engine beside a kept state): no sleep, no wake (its sleep would move the model to the host),
    torch's cache emptied for the update and timed as the engine's sleep; the weights are still synced after an
    update. Level 2 as before: asleep for training, woken in two halves around the sync."""
    from fastcredit.distributed.colocate import PhaseManager

    emptied, log = [], []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    engine = Engine(log)
    pm = PhaseManager(engine, train_state=[State(log)], device=torch.device("cuda", 0), policy_sleep_level=level,
                      move_state=False, sync_fn=lambda w: log.append("sync"))
    for _ in range(2):
        with pm.rollout(weights="policy"):
            log.append("generate")
        with pm.train():
            log.append("update")
        pm.mark_updated(1)
    with pm.rollout(weights="policy"):
        log.append("generate")
    if level == 0:
        assert log == ["generate", "update", "sync", "generate", "update", "sync", "generate"]
        # at each rollout (the kept state's blocks back to the driver, as before) and now at each update too
        assert len(emptied) == 5 and "engine_sleep" in pm.take_timings()
    else:
        step = [("sleep", 2), "update", ("wake", ["weights"]), "sync", ("wake", ["kv_cache"]), "generate"]
        assert log == ["generate", *step, *step] and len(emptied) == 3


def _share(monkeypatch, cfg_items, choice, free_gib=60.0, state=True):
    from fastcredit.trainer.roles import vllm_memory_share

    log, said = [], []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free_gib * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty"))
    cfg = load_config(None, ["rollout.engine=vllm", *cfg_items])
    util, offloaded = vllm_memory_share(cfg, torch.device("cuda", 0), "unused", [State(log)] if state else [],
                                        said.append, choice)
    return util, offloaded, log, said


def test_a_kept_state_gives_vllm_the_plans_share_checked_against_what_is_free(monkeypatch):
    kept = OffloadChoice(False, "kept", "auto", utilization=0.72)
    util, offloaded, log, said = _share(monkeypatch, [], kept)
    assert (util, offloaded, log) == (0.72, False, [])  # nothing moved, the plan's share
    assert said == ["vLLM gpu_memory_utilization 0.72 (the memory plan's): 60.0 of 80.0 GiB free beside the "
                    "training state"]
    with pytest.raises(MemoryBudgetError, match="only 50.0 GiB are free"):
        _share(monkeypatch, [], kept, free_gib=50.0)
    fixed = _share(monkeypatch, ["rollout.gpu_memory_utilization=0.5"], kept)
    assert fixed[0] == 0.5 and "(fixed)" in fixed[3][0]  # the user's share wins
    with pytest.raises(ConfigError, match="needs a fixed rollout.gpu_memory_utilization or the memory plan's"):
        _share(monkeypatch, [], OffloadChoice(False, "kept", False))  # false slipped past the config check


def test_a_moving_state_is_offloaded_before_vllm_measures_what_is_free(monkeypatch):
    util, offloaded, log, said = _share(monkeypatch, ["rollout.gpu_memory_utilization=0.5"],
                                        OffloadChoice(True, "moves"))
    assert (util, offloaded, log) == (0.5, True, ["offload", "empty"])
    assert "with the training state offloaded" in said[0]
    # a split placement's rollout rank: no training state and no choice, vLLM's share from what is free
    util, offloaded, log, said = _share(monkeypatch, ["rollout.gpu_memory_utilization=0.5"], None, state=False)
    assert (offloaded, log) == (False, []) and "no training state on this GPU" in said[0]
