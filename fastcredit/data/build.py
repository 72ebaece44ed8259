"""A run's questions and corpus, from the config: the toy world (generated once into ``data.world_dir``) or
Search-R1 / FlashRAG files.

    data = load_data(cfg, rank)            # Data(train, test, corpus): every rank, rank 0 writes what is generated
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from fastcredit.config import ConfigError, TrainConfig
from fastcredit.config.toy import world_key
from fastcredit.data.loaders import DataError, load_qa
from fastcredit.runtime.files import built_from, mark_built, wait_for_built


@dataclass
class Data:
    train: list  # QAExample
    test: list  # QAExample
    corpus: str  # Search-R1 corpus jsonl


def load_data(cfg: TrainConfig, rank: int = 0) -> Data:
    """The toy world (generated once into ``data.world_dir``, rank 0 writes) or Search-R1 / FlashRAG files.
    An empty training set, a row without the prompt ``data.prompt_source=parquet`` reads, or a missing
    ``retrieval.corpus`` is an error naming it (a missing file: ``check_paths``, before this runs)."""
    data = _read(cfg, rank)
    if not data.train:
        where = cfg.data.train_path if cfg.data.source != "toy" else os.path.join(cfg.data.world_dir, "train.jsonl")
        raise DataError(f"{where}: no training questions (an empty file?)")
    if cfg.data.prompt_source == "parquet":  # every row must bring its own prompt: say so before anything trains
        splits = (("train", cfg.data.train_path, data.train), ("test", cfg.data.test_path, data.test))
        for split, path, examples in splits:
            missing = next((ex for ex in examples if ex.prompt is None), None)
            if missing is not None:
                raise DataError(f"{path or cfg.data.world_dir}: {split} example {missing.id!r} has no 'prompt' field, "
                                "which data.prompt_source=parquet reads (the toy world has none; "
                                "data.prompt_source=template builds prompts from the questions)")
    if data.corpus is None and cfg.retrieval.backend == "local":
        raise ConfigError(f"data.source={cfg.data.source} needs retrieval.corpus: the corpus jsonl (Search-R1 format) "
                          "the retriever searches, the one its index was built from")
    return data


def _read(cfg: TrainConfig, rank: int) -> Data:
    if cfg.data.source == "toy":
        from fastcredit.data.toyworld import generate_world, write_world

        folder = cfg.data.world_dir
        key = {"toy": world_key(cfg.data.toy)}
        if rank == 0 and not built_from(folder, key):
            import shutil

            # the retriever's default index next to the corpus belongs to the old world
            shutil.rmtree(os.path.join(folder, "corpus.fastcredit"), ignore_errors=True)
            write_world(generate_world(cfg.data.toy), folder)
            mark_built(folder, key)
        wait_for_built(folder, key)
        return Data(load_qa(os.path.join(folder, "train.jsonl")), load_qa(os.path.join(folder, "test.jsonl")),
                    os.path.join(folder, "corpus.jsonl"))
    test = load_qa(cfg.data.test_path) if cfg.data.test_path else []
    return Data(load_qa(cfg.data.train_path), test, cfg.retrieval.corpus)
