"""Parallelism: process group and mesh, training engines (FSDP2, DeepSpeed ZeRO), weight streaming, colocation.

    engine.py            the TrainEngine boundary the update, weight sync, checkpoints and colocation call; FSDP2Engine
    fsdp.py              process group, mesh, FSDP2 wrapping, activation checkpointing, full-tensor streaming
    deepspeed_engine.py  DeepSpeed ZeRO stage 2 / 3 (distributed.engine=deepspeed), imported only when chosen
    colocate.py          the phase manager: engines sleep / wake, training state off / on the GPU

Model, loss and estimator code never imports ``torch.distributed`` or ``deepspeed``; it lives here.
"""
