"""The trainer: the loop (``loop.Trainer``), one step (``step``: its trajectories from ``sampling``, the learning
rate from ``schedule``), the parts a rank holds (``parts``: ``TrainingParts``, ``RolloutParts``), what a placement
gives the loop (``placement``: a batch source and a weights sink; ``split``: the split placement's), the run's
folder (``run``), the update, held-out evaluation, the warm start and the GPU / host memory plan. Import the
module you need: this package imports nothing, so ``--memory-report`` reads its plan without loading torch.
``from fastcredit.trainer import Trainer`` (the path of the one-module trainer before) still works: the name is
loaded on first use."""

_MOVED = {"Trainer": "fastcredit.trainer.loop", "CollapseError": "fastcredit.trainer.loop"}

__all__ = sorted(_MOVED)


def __getattr__(name: str):
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'fastcredit.trainer' has no attribute {name!r}")
