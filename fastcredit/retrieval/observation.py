"""Search-R1's observation format, as text and as token pieces.

Search-R1 (``search_r1/llm_agent/generation.py``) turns a search's documents into

    Doc 1(Title: <first line of contents>) <rest of contents>\\n
    Doc 2(Title: …) …\\n

(``_passages2string``; the title keeps the corpus's quotes) and wraps the stripped result as
``\\n\\n<information>…</information>\\n\\n`` (``execute_predictions``). The text functions here
reproduce that byte for byte. :class:`ObsTemplate` holds the same wrappers and ``Doc i``
headers as token ids of the policy tokenizer, for assembly from the token store.

NOTE: assembling tokens piecewise gives a token sequence that decodes to the same text,
but where a tokenizer would merge across a piece boundary (e.g. Qwen's pre-tokenizer joins
``>`` and ``Doc``) the ids differ from tokenizing the whole string at once.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

PREFIX = "\n\n<information>"
SUFFIX = "</information>\n\n"
SEP = "\n"


def header(i: int) -> str:
    """The header of the ``i``-th passage (0-based), ``Doc {i+1}``."""
    return f"Doc {i + 1}"


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1's split of ``contents``: the first line (title, quotes kept) and the rest."""
    title, _, text = contents.partition("\n")
    return title, text


def passages_to_string(contents: Iterable[str]) -> str:
    """Search-R1's ``_passages2string`` over the documents' ``contents`` fields."""
    parts = []
    for i, c in enumerate(contents):
        title, text = split_contents(c)
        parts.append(f"{header(i)}(Title: {title}) {text}\n")
    return "".join(parts)


def information_block(passages: str) -> str:
    """Search-R1's wrapping of a search result into the observation the policy sees."""
    return f"{PREFIX}{passages.strip()}{SUFFIX}"


def format_observation(contents: Iterable[str]) -> str:
    """``contents`` of the retrieved passages, best first → the observation string."""
    return information_block(passages_to_string(contents))


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class ObsTemplate:
    """Token ids of the observation's fixed pieces under one tokenizer.

    ``prefix`` / ``sep`` / ``suffix``: int32 ids of PREFIX, SEP, SUFFIX; ``headers`` int32 [H]
    with ``header_offsets`` int64 [max_k+1]: ids of ``Doc 1`` … ``Doc max_k`` back to back.
    """

    def __init__(self, tokenizer, max_k: int = 16):
        self.tokenizer = tokenizer
        self.prefix = torch.tensor(_ids(tokenizer, PREFIX), dtype=torch.int32)
        self.sep = torch.tensor(_ids(tokenizer, SEP), dtype=torch.int32)
        self.suffix = torch.tensor(_ids(tokenizer, SUFFIX), dtype=torch.int32)
        self.max_k = 0
        self._grow(max_k)
        self._device_cache: dict = {}

    def _grow(self, max_k: int) -> None:
        if max_k <= self.max_k:
            return
        pieces = [_ids(self.tokenizer, header(i)) for i in range(max_k)]
        lens = torch.tensor([0] + [len(p) for p in pieces], dtype=torch.int64)
        self.headers = torch.tensor([t for p in pieces for t in p], dtype=torch.int32)
        self.header_offsets = lens.cumsum(0)
        self.max_k = max_k
        self._device_cache = {}

    @property
    def wrapper_len(self) -> int:
        return self.prefix.numel() + self.suffix.numel()

    def tensors(self, k: int, device) -> dict:
        """The pieces as keyword arguments of ``assemble_observations``, on ``device``, for up to ``k`` passages."""
        self._grow(k)
        key = str(torch.device(device))
        if key not in self._device_cache:
            self._device_cache[key] = {
                "headers": self.headers.to(device), "header_offsets": self.header_offsets.to(device),
                "prefix": self.prefix.to(device), "sep": self.sep.to(device), "suffix": self.suffix.to(device),
            }
        return self._device_cache[key]


def unpack(tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> list[list[int]]:
    """Packed ``(out, cu_seqlens)`` → one Python list of ids per query."""
    flat, cu = tokens.tolist(), cu_seqlens.tolist()
    return [flat[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]


def decode_all(tokenizer, sequences: Sequence[Sequence[int]]) -> list[str]:
    return [tokenizer.decode(list(s), skip_special_tokens=False, clean_up_tokenization_spaces=False) for s in sequences]
