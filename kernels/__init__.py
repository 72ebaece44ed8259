"""Triton kernels, installed as ``fastcredit.kernels`` (one sub-package per op: naive.py, triton.py, README.md)."""
