"""distributed.offload_state reaches the phase manager and the reference policy: colocated on a GPU the default
moves the training state and starts the reference on the host (its passes bring it in); false keeps both on the
GPU, where a reference left on the host would meet its inputs on the wrong device."""
import os
import types

import pytest
import torch

from fastcredit.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=0",
         "optim.total_steps=0"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")  # made by the first trainer, read by the second


def test_the_state_moves_only_colocated_on_a_gpu_with_the_switch_on():
    from fastcredit.trainer.parts import moves_training_state

    gpu, cpu = types.SimpleNamespace(device=torch.device("cuda", 0)), types.SimpleNamespace(device=torch.device("cpu"))
    for items, info, moves in (([], gpu, True), (["distributed.offload_state=false"], gpu, False),
                               (["distributed.colocate=false"], gpu, False), ([], cpu, False)):
        assert moves_training_state(load_config(None, items), info) is moves, (items, info)


@pytest.mark.parametrize("keep", [False, True])
def test_the_switch_reaches_the_phase_manager_and_the_reference(monkeypatch, world, keep, tmp_path):
    """A CPU run standing in for a GPU one (``moves_training_state`` answers as on a GPU): the phase manager gets
    the same answer the reference's placement did."""
    import fastcredit.distributed.colocate as colocate
    import fastcredit.trainer.parts as parts
    from fastcredit.distributed.fsdp import FrozenModel
    from fastcredit.distributed.process_group import DistInfo
    from fastcredit.trainer.loop import Trainer

    made, offloads = [], []

    class Recorded(colocate.PhaseManager):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("move_state"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(colocate, "PhaseManager", Recorded)
    monkeypatch.setattr(parts, "moves_training_state", lambda cfg, info: cfg.distributed.offload_state)
    monkeypatch.setattr(FrozenModel, "offload", lambda self: offloads.append(self))
    cfg = load_config(os.path.join(ROOT, "configs", "debug.yaml"),
                      [f"data.world_dir={world}", f"logging.output_dir={tmp_path / 'run'}", *SMALL,
                       "loss.kl_coef=0.001", f"distributed.offload_state={str(not keep).lower()}"])
    trainer = Trainer(cfg, DistInfo())
    try:
        assert trainer.parts.ref is not None
        assert made == [not keep] and len(offloads) == (0 if keep else 1)
    finally:
        trainer.logger.close()
