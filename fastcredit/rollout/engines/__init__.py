"""Generation engines behind one interface (:class:`~fastcredit.rollout.engines.base.Engine`)."""
from fastcredit.rollout.engines.base import Engine, GenOutput, SamplingParams
from fastcredit.rollout.engines.hf import HFEngine, make_engine

__all__ = ["Engine", "GenOutput", "HFEngine", "SamplingParams", "make_engine"]
