"""Triton kernels, installed as ``fastcredit.kernels`` (one sub-package per op: naive.py, triton.py, README.md).

``_dispatch.py`` holds the one implementation choice (torch reference or kernel) that
``fastcredit.trainer.loss`` applies to every op.
"""
