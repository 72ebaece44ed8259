"""Parallelism: process group and mesh, training engines (FSDP2, DeepSpeed ZeRO), weight streaming, colocation.

    process_group.py     DistInfo, init / shutdown from torchrun's environment, reductions over ranks
    engine.py            the TrainEngine boundary the update, weight sync, checkpoints and colocation call;
                         what both engines do to an HF model (decoder layers, activation checkpointing, names)
    fsdp.py              FSDP2 wrapping, full-tensor streaming, FSDP2Engine
    deepspeed_engine.py  DeepSpeed ZeRO stage 2 / 3 (distributed.engine=deepspeed), imported only when chosen
    build.py             build_train_engine: the engine distributed.engine names
    colocate.py          the phase manager: engines sleep / wake, training state off / on the GPU

Model, loss and estimator code never imports ``torch.distributed`` or ``deepspeed``; it lives here.
"""
