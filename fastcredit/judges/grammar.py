"""Verdict grammars: decode a judge under its verdict format, so that what it writes always parses.

    g = verdict_grammar("criticsearch", n_labels=3)   # free analysis, then <score>b, b, b</score>
    SamplingParams(max_tokens=256, constraint=g)      # vLLM: structured outputs g.regex(256); HF: g.decoder(...)

A grammar is a sequence of pieces: :class:`Free` text (any characters but one, the first
character of the piece after it) and :class:`Lit` (one of a few strings). Every verdict is
``Free`` analysis, then markup whose labels are fixed in number and alphabet:

* ``criticsearch``: ``<score>`` then exactly ``n`` labels in {0, 1} separated by ``", "``, ``</score>``;
* ``pivot``: ``<labels>`` then exactly ``n`` labels in {+, -} separated by ``", "``, ``</labels>``;
* ``cwgrpo``: ``{"thinking_reward": b, "retrieval_reward": b}`` (the analysis may not hold ``{``);
* ``process``: ``<rating>N</rating>`` with N in 0..10, then ``<critique>…</critique>`` (at most
  ``critique_tokens``).

Analysis first, verdict last: the analysis may not hold the verdict's first character (``<``
or ``{``); writing it starts the verdict. Its length is bounded by what ``max_tokens`` leaves
after the worst case of the rest (one character per token), so the verdict always fits.

Two engines, one format. vLLM gets :meth:`Grammar.regex` (``StructuredOutputsParams(regex=...)``,
compiled by xgrammar); a free piece there is bounded in characters (``[^<]{0,K}``: K characters
are at most K tokens). The HF engine masks logits with :meth:`Grammar.decoder`, a per-row state
machine over the same pieces that bounds free pieces in tokens. Both stop as soon as the verdict
is complete. See :class:`VerdictDecoder` for the token-level design.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import torch

_REGEX_SPECIAL = set("\\.^$*+?{}[]|()")


@dataclass(frozen=True)
class Free:
    """Free text without ``excluded`` (the next piece starts with it); at most ``budget`` tokens
    (None: what the output budget leaves; only the first piece may have none)."""
    excluded: str
    budget: Optional[int] = None


@dataclass(frozen=True)
class Lit:
    """One of ``options`` (non-empty strings)."""
    options: tuple


Piece = Union[Free, Lit]


def _escape(s: str) -> str:
    return "".join("\\n" if c == "\n" else "\\" + c if c in _REGEX_SPECIAL else c for c in s)


@dataclass(frozen=True)
class Grammar:
    """A verdict format (see the module docstring); ``tokenizer``: the one the HF engine decodes it against
    (None: the engine's own)."""
    name: str
    pieces: tuple
    tokenizer: Any = field(default=None, compare=False, hash=False, repr=False)

    def bind(self, tokenizer) -> "Grammar":
        return replace(self, tokenizer=tokenizer)

    def reserve(self, start: int = 1) -> int:
        """Worst-case tokens of ``pieces[start:]`` (one character per token)."""
        return sum(max(map(len, p.options)) if isinstance(p, Lit) else p.budget for p in self.pieces[start:])

    def analysis_budget(self, max_tokens: int) -> int:
        """Tokens the leading free piece may use so that the rest always fits in ``max_tokens``."""
        need = self.reserve(1)
        if max_tokens < need:
            raise ValueError(f"max_tokens={max_tokens} cannot hold a {self.name} verdict: it needs up to {need} tokens")
        first = self.pieces[0]
        return max_tokens - need if first.budget is None else min(first.budget, max_tokens - need)

    def regex(self, max_tokens: Optional[int] = None) -> str:
        """The whole output as a regex (vLLM's structured outputs); None: free pieces unbounded."""
        parts = []
        for i, p in enumerate(self.pieces):
            if isinstance(p, Lit):
                parts.append("(?:" + "|".join(_escape(o) for o in p.options) + ")")
                continue
            k = (self.analysis_budget(max_tokens) if i == 0 else p.budget) if max_tokens is not None else None
            parts.append(f"[^{_escape(p.excluded)}]" + ("*" if k is None else f"{{0,{k}}}"))
        return "".join(parts)

    def decoder(self, tokenizer, max_tokens: int, vocab_size: int, stop_ids=()) -> "VerdictDecoder":
        """One row's logits processor for the HF engine (``stop_ids``: the row's stop tokens, e.g. EOS)."""
        return VerdictDecoder(self, token_table(tokenizer), max_tokens, vocab_size, stop_ids)

    # The character-level automaton: a state is a frozenset of (piece index, text of that piece so far).
    @property
    def start(self) -> frozenset:
        return frozenset({(0, "")})

    def step(self, states: frozenset, text: str) -> frozenset:
        """The states after ``text`` (empty: ``text`` leaves the grammar)."""
        for c in text:
            nxt: set = set()
            for i, part in states:
                nxt |= self._char(i, part, c)
            if not nxt:
                return frozenset()
            states = frozenset(nxt)
        return states

    def _char(self, i: int, part: str, c: str) -> set:
        if i == len(self.pieces):
            return set()
        p = self.pieces[i]
        if isinstance(p, Free):
            return {(i, "")} if c != p.excluded else self._char(i + 1, "", c)
        new = part + c
        out = set()
        if any(o.startswith(new) and o != new for o in p.options):
            out.add((i, new))
        if new in p.options:
            out.add((i + 1, ""))
        return out

    def complete(self, states: frozenset) -> bool:
        return (len(self.pieces), "") in states

    def free_piece(self, states: frozenset) -> Optional[int]:
        """The free piece the automaton is in, if any."""
        for i, _ in states:
            if i < len(self.pieces) and isinstance(self.pieces[i], Free):
                return i
        return None


def _bits(n: int, symbols: tuple = ("0", "1")) -> list:
    out = []
    for k in range(n):
        out += [Lit((", ",))] if k else []
        out.append(Lit(symbols))
    return out


@functools.lru_cache(maxsize=256)
def verdict_grammar(kind: str, n_labels: Optional[int] = None, critique_tokens: int = 128) -> Grammar:
    """The verdict format of ``kind`` (``criticsearch`` and ``pivot`` need ``n_labels``: search turns, turns)."""
    if critique_tokens < 1:
        raise ValueError(f"critique_tokens must be at least 1, got {critique_tokens}")
    if kind in ("criticsearch", "pivot") and (n_labels is None or n_labels < 0):
        raise ValueError(f"a {kind} verdict needs its number of labels, got {n_labels!r}")
    if kind == "criticsearch":
        pieces = [Free("<"), Lit(("<score>",)), *_bits(n_labels), Lit(("</score>",))]
    elif kind == "pivot":
        pieces = [Free("<"), Lit(("<labels>",)), *_bits(n_labels, ("+", "-")), Lit(("</labels>",))]
    elif kind == "cwgrpo":
        pieces = [Free("{"), Lit(('{"thinking_reward": ',)), Lit(("0", "1")), Lit((', "retrieval_reward": ',)),
                  Lit(("0", "1")), Lit(("}",))]
    elif kind == "process":
        pieces = [Free("<"), Lit(("<rating>",)), Lit(tuple(str(k) for k in range(11))),
                  Lit(("</rating>\n<critique>",)), Free("<", critique_tokens), Lit(("</critique>",))]
    else:
        raise ValueError(f"no verdict grammar for judge kind {kind!r}; valid: criticsearch, cwgrpo, process, pivot")
    return Grammar(f"{kind}({n_labels})" if kind in ("criticsearch", "pivot") else kind, tuple(pieces))


class TokenTable:
    """Every token's text as it reads inside a sequence, and indexes over it (one per tokenizer).

    Special tokens and tokens with no text are never allowed in a constrained row: a verdict decoded
    with ``skip_special_tokens`` must read as the automaton saw it.
    """

    def __init__(self, tokenizer):
        n = len(tokenizer)
        anchor = tokenizer.encode("a", add_special_tokens=False)[:1]
        head = tokenizer.decode(anchor, clean_up_tokenization_spaces=False)
        # NOTE: decoded after an anchor token, so SentencePiece's leading-space marker reads as a space.
        pairs = tokenizer.batch_decode([anchor + [i] for i in range(n)], clean_up_tokenization_spaces=False)
        special = set(tokenizer.all_special_ids) | {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                                   if getattr(t, "special", False)}
        self.text = [s[len(head):] if s.startswith(head) else tokenizer.decode([i]) for i, s in enumerate(pairs)]
        usable = [bool(s) and i not in special for i, s in enumerate(self.text)]
        self.usable = torch.tensor(usable)
        self.sorted_ids = sorted((i for i in range(n) if usable[i]), key=self.text.__getitem__)
        self.sorted_text = [self.text[i] for i in self.sorted_ids]
        self._without: dict = {}
        self._holding: dict = {}
        self.masks: dict = {}  # (grammar, states, stay) -> bool [n]

    def __len__(self) -> int:
        return len(self.text)

    def prefix_range(self, prefix: str) -> tuple[int, int]:
        """``[lo, hi)`` of the usable tokens (in ``sorted_ids``) whose text starts with ``prefix``."""
        return (bisect.bisect_left(self.sorted_text, prefix),
                bisect.bisect_left(self.sorted_text, prefix + "\U0010ffff") if prefix else len(self.sorted_text))

    def without(self, c: str) -> torch.Tensor:
        """Usable tokens whose text lacks ``c`` (they keep a free piece going)."""
        if c not in self._without:
            self._without[c] = self.usable & torch.tensor([c not in s for s in self.text])
        return self._without[c]

    def holding(self, c: str) -> list:
        """Usable tokens whose text holds ``c`` (one of them may leave a free piece)."""
        if c not in self._holding:
            self._holding[c] = [i for i in self.sorted_ids if c in self.text[i]]
        return self._holding[c]


_TABLES: dict = {}


def token_table(tokenizer) -> TokenTable:
    """The (cached) :class:`TokenTable` of ``tokenizer``."""
    got = _TABLES.get(id(tokenizer))
    if got is None or got[0] is not tokenizer:
        got = _TABLES[id(tokenizer)] = (tokenizer, TokenTable(tokenizer))
    return got[1]


class VerdictDecoder:
    """The HF engine's logits processor for one row: :meth:`apply` before sampling, :meth:`advance` after.

    State: the grammar's automaton state (which piece, how much of it is written) and the tokens
    spent in the current free piece. A token is allowed when its whole text keeps the automaton
    alive; in a free piece whose budget is spent, only tokens that leave it (they hold the next
    piece's first character) are. Free pieces' budgets and the worst case of the markup sum to at
    most ``max_tokens``, and every allowed token writes at least one character, so the verdict is
    complete within ``max_tokens``; the engine ends the row as soon as it is (:attr:`done`).
    Stop tokens (EOS) are never sampled: in a free piece their probability goes to the likeliest
    token that leaves it, so a judge that wants to end its analysis starts its verdict there
    instead of writing on until the budget forces it.
    Masks are cached per (grammar, state, budget spent) in the tokenizer's table: the states
    repeat across rows and calls, so each is computed once.
    """

    def __init__(self, grammar: Grammar, table: TokenTable, max_tokens: int, vocab_size: int, stop_ids=()):
        self.grammar, self.table, self.vocab_size = grammar, table, vocab_size
        self.stop_ids = [i for i in stop_ids if 0 <= i < vocab_size]
        self.budgets = [grammar.analysis_budget(max_tokens) if i == 0 else getattr(p, "budget", None)
                        for i, p in enumerate(grammar.pieces)]
        self.states, self.spent, self.piece = grammar.start, 0, grammar.free_piece(grammar.start)

    @property
    def done(self) -> bool:
        return self.grammar.complete(self.states)

    def apply(self, logits_V: torch.Tensor) -> torch.Tensor:
        """Constrain one row's next-token logits in place (see the class docstring); returns them."""
        allowed, leaving = self.allowed()
        if self.stop_ids and leaving.any():
            # The model ending its free text starts the next piece: the stop tokens' mass goes to the likeliest
            # token that leaves (greedy: when a stop token would win, it does).
            leaving = leaving.to(logits_V.device)
            best = int(torch.where(leaving, logits_V, -float("inf")).argmax())
            logits_V[best] = torch.logaddexp(logits_V[best], logits_V[self.stop_ids].logsumexp(0))
        logits_V.masked_fill_(~allowed.to(logits_V.device), -float("inf"))
        logits_V[self.stop_ids] = -float("inf")  # a stop token would end the row before the verdict does
        return logits_V

    def allowed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Bool ``[vocab_size]`` twice: the tokens this row may sample next, and those of them that leave the
        free piece it is in (none outside free pieces)."""
        stay = self.piece is not None and self.spent < self.budgets[self.piece]
        key = (self.grammar, self.states, stay)
        masks = self.table.masks.get(key)
        if masks is None:
            masks = self.table.masks[key] = self._mask(stay)
        if self.vocab_size != len(self.table):  # the model's vocabulary may be padded past the tokenizer's
            pad = torch.zeros(max(0, self.vocab_size - len(self.table)), dtype=torch.bool)
            masks = tuple(torch.cat([m, pad])[:self.vocab_size] for m in masks)
        return masks

    def _mask(self, stay: bool) -> tuple[torch.Tensor, torch.Tensor]:
        t, g = self.table, self.grammar
        mask = torch.zeros(len(t), dtype=torch.bool)
        candidates: set = set()
        free = [g.pieces[i] for i, _ in self.states if i < len(g.pieces) and isinstance(g.pieces[i], Free)]
        for p in free:
            if stay:
                mask |= t.without(p.excluded)  # they keep the free piece going: no check needed
            candidates.update(t.holding(p.excluded))
        if not free:
            self._walk("", self.states, candidates)
        ok = [k for k in candidates if self._allows(k, stay)]
        mask[torch.tensor(ok, dtype=torch.long)] = True
        if not mask.any():
            raise RuntimeError(f"no token of this tokenizer continues the {g.name} verdict from {sorted(self.states)}")
        leaving = torch.zeros(len(t), dtype=torch.bool)
        if free:
            leaving[torch.tensor([k for k in ok if not self._keeps_free(k)], dtype=torch.long)] = True
        return mask, leaving

    def _walk(self, prefix: str, states: frozenset, out: set) -> None:
        """Tokens whose text the automaton reads from ``states`` (a depth-first walk over the sorted token texts:
        only the characters the literals allow are followed, so a walk visits a handful of prefixes)."""
        t, g = self.table, self.grammar
        lo, hi = t.prefix_range(prefix)
        if lo == hi:
            return
        if prefix:
            j = lo
            while j < hi and t.sorted_text[j] == prefix:
                out.add(t.sorted_ids[j])
                j += 1
        if g.free_piece(states) is not None:  # free text inside this token: check each token under the prefix
            out.update(t.sorted_ids[lo:hi])
            return
        nxt = {o[len(part)] for i, part in states if i < len(g.pieces)
               for o in g.pieces[i].options if o.startswith(part) and len(o) > len(part)}
        for c in nxt:
            after = g.step(states, c)
            if after:
                self._walk(prefix + c, after, out)

    def _keeps_free(self, k: int) -> bool:
        return self.piece is not None and self.grammar.pieces[self.piece].excluded not in self.table.text[k]

    def _allows(self, k: int, stay: bool) -> bool:
        after = self.grammar.step(self.states, self.table.text[k])
        return bool(after) and (stay or self.piece is None or self.grammar.free_piece(after) != self.piece)

    def advance(self, token: int) -> None:
        after = self.grammar.step(self.states, self.table.text[token])
        if not after:
            raise RuntimeError(f"token {token} ({self.table.text[token]!r}) leaves the {self.grammar.name} grammar")
        piece = self.grammar.free_piece(after)
        self.spent = self.spent + 1 if piece is not None and piece == self.piece else (1 if piece is not None else 0)
        self.states, self.piece = after, piece
