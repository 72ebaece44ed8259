"""Parallelism: process group and mesh, FSDP2 wrapping, weight streaming, colocation phases.

Model, loss and estimator code never imports ``torch.distributed``; it lives here.
"""
