"""Critics and judges: prompts, defensive parsers, backends, runners, and the trainer's judge phase.

    types.py     what a judge reads about a trajectory (JudgeItem, StepText)
    prompts.py   CriticSearch / CW-GRPO / process-critic / refiner / PiCA pivot prompts
    untrusted.py agent text made harmless before it enters a prompt (neutralise) and its echoes in outputs
    parsers.py   defensive verdict parsers (never raise; None on failure)
    grammar.py   verdict grammars: judges decode under their verdict format (judges.constrained)
    backends.py  HTTP (OpenAI-compatible) and colocated-engine backends
    oracle.py    the toy world's gold facts as judge backend and as PRM
    runner.py    the judges: ask, parse, re-ask failures, count
    phase.py     the training step's judge phase and the ProCeed hook, built from the config

Critic and judge outputs are untrusted text: parsers never raise, failures are counted,
and a trajectory's own text is neutralised before it enters a prompt so it cannot forge
a verdict (:func:`fastcredit.judges.untrusted.neutralise`).
"""
