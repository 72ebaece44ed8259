"""Critics and judges: prompts, defensive parsers, backends (HTTP, colocated engine, toy-world oracle), runners.

Critic and judge outputs are untrusted text: parsers never raise, failures are counted,
and a trajectory's own text is neutralised before it enters a prompt so it cannot forge
a verdict (:func:`fastcredit.judges.prompts.neutralise`).
"""
