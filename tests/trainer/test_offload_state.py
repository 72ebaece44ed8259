"""distributed.offload_state reaches the phase manager: the default lets it move the training state wherever it
trains colocated on a GPU (``move_state`` None: decided by the device), false keeps the state where it is."""
import os

import pytest

from fastcredit.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["data.toy.num_people=80", "data.toy.num_companies=20", "data.toy.num_questions=60", "eval.questions=0",
         "optim.total_steps=0"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")  # made by the first trainer, read by the second


@pytest.mark.parametrize("keep", [False, True])
def test_the_switch_reaches_the_phase_manager(tmp_path, monkeypatch, world, keep):
    import fastcredit.distributed.colocate as colocate
    from fastcredit.distributed.process_group import DistInfo
    from fastcredit.trainer.loop import Trainer

    made = []

    class Recorded(colocate.PhaseManager):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("move_state"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(colocate, "PhaseManager", Recorded)
    cfg = load_config(os.path.join(ROOT, "configs", "debug.yaml"),
                      [f"data.world_dir={world}", f"logging.output_dir={tmp_path / 'run'}", *SMALL,
                       f"distributed.offload_state={str(not keep).lower()}"])
    trainer = Trainer(cfg, DistInfo())
    try:
        assert made == [False if keep else None]
        assert trainer.parts.phases.move_state is False  # on a CPU nothing moves either way
    finally:
        trainer.logger.close()
