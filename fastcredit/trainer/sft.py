"""Supervised warm start on oracle trajectories: a tiny policy learns the action format first.

A random tiny policy never writes ``<search>…</search>``, so RL from scratch has no
signal. The embedded default (and ``bench/bench_rollout.py``) first trains it on oracle
trajectories of the toy world (``fastcredit.data.toyqa.oracle_actions``: each hop's
gold sub-query, then the gold answer, each think quoting the fact just read), with
observations as the retriever returns them, so the warm-started policy sees the same
observation format in rollouts. The loss is the token cross-entropy on action tokens
only: prompt and observation tokens are context.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pickle
import random
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from fastcredit.data.loaders import QAExample
from fastcredit.runtime.files import atomic_output

# observe(query) -> observation token ids (e.g. a retriever's top-k, formatted as Search-R1 does)
Observer = Callable[[str], list[int]]


def oracle_token_turns(example: QAExample, tokenizer, observe: Observer, rng: Optional[random.Random] = None,
                       actions: Optional[Callable] = None) -> list[tuple[list[int], list[int]]]:
    """``(action ids, observation ids)`` per turn of the oracle trajectory; the answer turn has no observation.

    ``actions(example, rng) -> [(action text, query or None)]``: the turns' texts (default:
    :func:`fastcredit.data.toyqa.oracle_actions`; the rollout benchmark draws skewed ones)."""
    if actions is None:
        from fastcredit.data.toyqa import oracle_actions as actions

    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    return [(enc(action), observe(query) if query is not None else []) for action, query in actions(example, rng)]


def sft_sequences(examples: Sequence[QAExample], prompt_ids: Sequence[Sequence[int]], tokenizer, observe: Observer,
                  seed: int = 0, actions: Optional[Callable] = None) -> list[tuple[list[int], list[int]]]:
    """``(input ids, labels)`` per example: labels are -100 on prompt and observation tokens."""
    rng = random.Random(seed)
    out = []
    for ex, prompt in zip(examples, prompt_ids):
        ids, labels = list(prompt), [-100] * len(prompt)
        for action, obs in oracle_token_turns(ex, tokenizer, observe, rng=rng, actions=actions):
            ids += action + obs
            labels += action + [-100] * len(obs)
        out.append((ids, labels))
    return out


def _batches(seqs, batch_size: int, pad_id: int, rng: random.Random):
    # Random, not length-grouped, batches: on the demo's warm start, grouping by length saved
    # about 15% of the time but copying emerged later (test loss 0.90 vs 0.82 after 6 epochs).
    order = list(range(len(seqs)))
    rng.shuffle(order)
    for i in range(0, len(order), batch_size):
        chunk = [seqs[j] for j in order[i:i + batch_size]]
        L = max(len(s[0]) for s in chunk)
        ids = torch.full((len(chunk), L), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), L), -100, dtype=torch.long)
        mask = torch.zeros((len(chunk), L), dtype=torch.long)
        for r, (x, y) in enumerate(chunk):
            ids[r, :len(x)], labels[r, :len(y)], mask[r, :len(x)] = torch.tensor(x), torch.tensor(y), 1
        yield ids, labels, mask


def labelled_cross_entropy(model, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over labelled positions, with the LM head applied only there.

    Actions are a small share of an oracle trajectory (prompt and observations are context),
    so projecting only the positions that predict a label skips most of the head's FLOPs.
    """
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    logits = model.get_output_embeddings()(hidden[keep])
    return F.cross_entropy(logits.float(), target[keep])


def sft_train(model, seqs: list[tuple[list[int], list[int]]], pad_id: int, epochs: int = 3, lr: float = 3e-3,
              batch_size: int = 16, seed: int = 0, device: str = "cpu", progress: bool = True,
              on_epoch: Optional[Callable[[int, float], None]] = None, threads: int = 0) -> list[float]:
    """Cross-entropy on the labelled tokens; AdamW with a cosine decay. Returns the mean loss per epoch;
    ``on_epoch(epoch, mean loss)`` is called after each (a status line where no progress bar shows).
    ``threads``: torch's intra-op threads while it trains on the CPU (0: as they are), restored after: the
    weights then do not depend on the machine's core count (``warmstart.threads``).

    The model is moved to ``device`` and left there (the policy is read onto the CPU, and training it there while
    the batches go to a GPU was the warm start's first GPU failure); a caller that wants it back moves it."""
    with intra_op_threads(threads if torch.device(device).type == "cpu" else 0):
        return _sft_train(model, seqs, pad_id, epochs, lr, batch_size, seed, device, progress, on_epoch)


@contextlib.contextmanager
def intra_op_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block (0: left as they are)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(before)


def _sft_train(model, seqs, pad_id: int, epochs: int, lr: float, batch_size: int, seed: int, device: str,
               progress: bool, on_epoch: Optional[Callable[[int, float], None]]) -> list[float]:
    from fastcredit.runtime.progress import progress_bar

    model.to(device)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * math.ceil(len(seqs) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / max(steps, 1), 1.0))))
    model.train()
    history = []
    bar = progress_bar(total=steps, desc="warm start (SFT)", unit="step", disable=not progress, leave=False)
    for _ in range(epochs):
        total, n = 0.0, 0
        for ids, labels, mask in _batches(seqs, batch_size, pad_id, rng):
            ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
            loss = labelled_cross_entropy(model, ids, labels, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            total, n = total + loss.item(), n + 1
            bar.set_postfix(loss=f"{total / n:.3f}", refresh=False)
            bar.update(1)
        history.append(total / max(n, 1))
        if on_epoch is not None:
            on_epoch(len(history), history[-1])
    bar.close()
    opt.zero_grad(set_to_none=True)  # no stale gradients leak into the RL optimizer or a checkpoint load
    model.eval()
    return history


# The config sections a warm start depends on. The run seed is not one of them: the warm start's own seed is
# (``warmstart.seed_for``), so runs that differ only in their run seed share one warm start when ``warmstart.seed`` is
# set (a comparison over seeds). Of the rollout section only what shapes the oracle trajectories' observations.
WARM_START_KEYS = ("data", "model", "retrieval", "warmstart")
WARM_START_ROLLOUT_KEYS = ("max_obs_tokens",)
# Of the retrieval section, what cannot change the observations: where the searches go (in-process or a server
# of the same index, bench_step's Search-R1 design), how they are batched, and how ranks split an index (the merged
# lists are one index's, fastcredit.retrieval.ranks). What reaches a score (index, encoder, device, dtype) stays.
WARM_START_IGNORED_RETRIEVAL = ("backend", "url", "batch_size", "batch_timeout_ms", "round_cadence_ms",
                                "across_ranks", "num_shards", "build_index")


def warm_start_fingerprint(cfg, tokenizer=None) -> str:
    """A digest of what determines the warm-started weights: ``WARM_START_KEYS`` (minus the cache and world
    folders, and ``WARM_START_IGNORED_RETRIEVAL``), the observation cap, the warm start's seed and threads, and the
    ``tokenizer``'s vocabulary (weights trained on other token ids would load, and generate nonsense)."""
    from fastcredit.config import to_dict
    from fastcredit.config.toy import world_key

    d = to_dict(cfg)
    part = {k: d[k] for k in WARM_START_KEYS}
    part["warmstart"] = {k: v for k, v in part["warmstart"].items() if k not in ("cache_dir", "seed")}
    for key in ("detour_fraction", "waste_prob", "misquery_prob"):  # added later: older cached warm starts load
        if not part["warmstart"][key]:
            del part["warmstart"][key]
    part["data"] = {k: v for k, v in part["data"].items() if k != "world_dir"}
    part["data"]["toy"] = world_key(cfg.data.toy)  # a chain world's as before the lookup kind existed
    part["retrieval"] = {k: v for k, v in part["retrieval"].items() if k not in WARM_START_IGNORED_RETRIEVAL}
    part["rollout"] = {k: d["rollout"][k] for k in WARM_START_ROLLOUT_KEYS}
    part["seed"] = cfg.warmstart.seed_for(cfg.seed)
    # the threads it trains with on a CPU (float sums follow them); 0 leaves torch's default, this machine's count
    part["warmstart"]["threads"] = cfg.warmstart.threads or torch.get_num_threads()
    if tokenizer is not None:
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
        part["tokenizer"] = hashlib.sha256(vocab.encode("utf-8")).hexdigest()[:16]
    return hashlib.sha256(json.dumps(part, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_warm_start(model, folder: Optional[str], fingerprint: str, run: Callable[[], str], say: Callable) -> None:
    """Warm-start ``model`` with ``run()`` (which returns a summary line), or load the weights a run with the same
    fingerprint saved in ``folder``; a new warm start is saved there (written whole, then renamed).

    A model on the meta device (a rank whose weights come from rank 0) takes the same branch as rank 0, so it
    joins the same collectives inside ``run()``, but neither loads nor saves weights."""
    from fastcredit.distributed.from_rank0 import has_meta

    path = None if not folder else os.path.join(folder, f"warmstart_{fingerprint}.pt")
    meta = has_meta(model)
    if path and os.path.exists(path):
        if meta:
            return
        try:
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except (RuntimeError, OSError, ValueError, EOFError, pickle.UnpicklingError) as exc:
            raise RuntimeError(f"{path}: cannot load the cached warm start ({exc}); delete it to warm-start again") \
                from None
        say(f"warm start: loaded from {path}")
        return
    say(run())
    if path and not meta:
        os.makedirs(folder, exist_ok=True)
        with atomic_output(path) as tmp:
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
        say(f"warm start: saved to {path}")


def warm_start(lm, cfg, data, tokenizer, searcher, info, say: Callable[[str], None]) -> None:
    """SFT of ``lm`` on oracle trajectories; observations come from the run's own searcher, as in rollouts. With
    ``warmstart.cache_dir`` a warm start of the same config is loaded instead of redone (``sft.cached_warm_start``)."""
    from fastcredit.data.detours import choose_detours, planned_queries
    from fastcredit.data.toyqa import oracle_actions
    from fastcredit.distributed.from_rank0 import has_meta
    from fastcredit.rollout.build import prompt_ids

    w = cfg.warmstart
    seed = w.seed_for(cfg.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # what the SFT batches pad with

    def run() -> str:
        examples = [ex for ex in data.train if ex.metadata.get("hops")]
        examples = examples[: w.questions] if w.questions else examples
        t0 = time.time()
        if cfg.data.toy.kind == "lookup":
            queries, actions, made = lookup_demonstrations(cfg, examples, seed)
        else:
            plan = detour_plan(cfg, examples, seed)
            queries = sorted({h["query"] for ex in examples for h in ex.metadata["hops"]} | set(planned_queries(plan)))
        found = dict(zip(queries, searcher(queries)))  # on every rank: the searcher may be split over the ranks
        if has_meta(lm):  # loads_on_rank0: rank 0 warm-starts the weights every rank is filled from
            return "warm start: on rank 0"
        if cfg.data.toy.kind == "lookup":
            actions = actions({q: ids for q, (_, ids) in found.items()})
        else:
            detours = choose_detours(plan, examples, {q: ids for q, (_, ids) in found.items()})
            actions = lambda ex, rng: oracle_actions(ex, rng, detour=detours.get(ex.id))  # noqa: E731
            made = f" ({len(detours)} with a detour)" if w.detour_fraction else ""
        seqs = sft_sequences(examples, prompt_ids(cfg, tokenizer, examples), tokenizer, lambda q: found[q][0],
                             seed=seed, actions=actions)
        made = made() if callable(made) else made
        bar = cfg.logging.progress and info.is_main
        losses = sft_train(lm, seqs, pad_id, w.epochs, w.lr, w.batch_size, seed, str(info.device),
                           progress=bar, on_epoch=None if bar else lambda k, loss: say(
                               f"warm start: epoch {k}/{w.epochs}, loss {loss:.3f} ({time.time() - t0:.0f} s)"),
                           threads=w.threads)
        # the mean loss of the first epoch and of the last (one epoch: its mean)
        loss = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if len(losses) > 1 else f"{losses[0]:.3f}"
        epochs = f"{w.epochs} epoch{'s' if w.epochs > 1 else ''}"
        return f"warm start: {len(seqs)} oracle trajectories{made} x {epochs} in {time.time() - t0:.0f} s, loss {loss}"

    cached_warm_start(lm, w.cache_dir, warm_start_fingerprint(cfg, tokenizer), run, say)
    lm.requires_grad_(True).train()


def detour_plan(cfg, examples: list, seed: int) -> dict:
    """The warm start's planned detours (``fastcredit.data.detours.plan_detours``, ``warmstart.detour_fraction`` of
    the examples; the world's entities read from ``data.world_dir``); empty at fraction 0."""
    if not cfg.warmstart.detour_fraction:
        return {}
    from fastcredit.data.detours import plan_detours
    from fastcredit.data.toyworld import load_world

    entities = load_world(cfg.data.world_dir).entities
    return plan_detours(examples, entities, cfg.warmstart.detour_fraction, random.Random(f"detours-{seed}"))


def lookup_demonstrations(cfg, examples: list, seed: int) -> tuple[list, Callable, Callable[[], str]]:
    """The lookup world's demonstrations (``fastcredit.data.lookup_demos``): ``(queries, actions_for, summary)``.
    ``queries``: every query they may search, to be searched once with the run's retriever; ``actions_for(found)``,
    given each query's retrieved passage ids, the ``actions(example, rng)`` of :func:`sft_sequences`; ``summary()``,
    once they are made, the share of their searches that were not the needed entity's full name, for the warm
    start's line. The mistakes are drawn from the warm start's seed."""
    from fastcredit.data.lookup import gold_query
    from fastcredit.data.lookup_demos import demo_queries, lookup_actions, passage_reader, plan_lookup_demos
    from fastcredit.data.toyqa import question_hops
    from fastcredit.data.toyworld import load_world

    w = cfg.warmstart
    world = load_world(cfg.data.world_dir)
    pool = sorted(n for n, e in world.entities.items() if e.get("split") == "train" and "decoy_of" not in e)
    plans = plan_lookup_demos(examples, pool, w.waste_prob, w.misquery_prob, random.Random(f"lookup-demos-{seed}"))
    read = passage_reader(world)
    counts = [0, 0]  # searches, searches of anything but the next needed entity's full name

    def actions_for(found: dict) -> Callable:
        def actions(ex, rng):
            out = lookup_actions(ex, plans[ex.id], found.__getitem__, read)
            wanted = [gold_query(h["subject"]) for h in question_hops(ex)]
            queries = [q for _, q in out if q is not None]
            counts[0] += len(queries)
            counts[1] += sum(q not in wanted or q in queries[:i] for i, q in enumerate(queries))
            return out
        return actions

    def summary() -> str:
        return f" ({counts[1] / max(counts[0], 1):.1%} of {counts[0]} searches erring)"

    return demo_queries(examples, plans), actions_for, summary
