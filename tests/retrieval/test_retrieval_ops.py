"""merge_topk and assemble_observations: the torch path against loop references, and (on a
GPU with the extension built) the CUDA kernels against the torch path."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcredit._ext import cuda_ext, cuda_ext_status
from fastcredit.retrieval.ops import assemble_observations, merge_topk


def merge_naive(scores, ids, k):
    """All candidates, ordered by (-score, shard, position): the stable order, spelled out."""
    S, Q, K = scores.shape
    out_s, out_i = [], []
    for q in range(Q):
        cand = sorted(((-float(scores[s, q, j]), s, j) for s in range(S) for j in range(K)))[:k]
        out_s.append([-c[0] for c in cand])
        out_i.append([int(ids[c[1], q, c[2]]) for c in cand])
    return torch.tensor(out_s, dtype=torch.float32).view(Q, k), torch.tensor(out_i, dtype=torch.int64).view(Q, k)


def random_shards(S, Q, K, levels, seed):
    """Per-shard descending lists; few distinct levels force ties across and within shards."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (S, Q, K), generator=g).float() / levels
    scores = scores.sort(dim=2, descending=True).values
    ids = torch.randperm(S * Q * K, generator=g).view(S, Q, K)
    return scores.contiguous(), ids.contiguous()


@settings(max_examples=60)
@given(S=st.integers(1, 5), Q=st.integers(0, 6), K=st.integers(1, 7), levels=st.sampled_from([2, 5, 1000]),
       data=st.data())
def test_merge_topk_matches_stable_order(S, Q, K, levels, data):
    k = data.draw(st.integers(0, S * K))
    scores, ids = random_shards(S, Q, K, levels, data.draw(st.integers(0, 2**16)))
    got_s, got_i = merge_topk(scores, ids, k)
    want_s, want_i = merge_naive(scores, ids, k)
    assert torch.equal(got_s, want_s) and torch.equal(got_i, want_i)


def test_merge_topk_rejects_bad_input():
    s, i = random_shards(2, 3, 4, 10, 0)
    with pytest.raises(ValueError, match="k=9"):
        merge_topk(s, i, 9)
    with pytest.raises(ValueError, match="must both be"):
        merge_topk(s[0], i[0], 2)
    with pytest.raises(ValueError, match="float32"):
        merge_topk(s.double(), i, 2)


def assemble_naive(tokens, offsets, rows, headers, header_offsets, prefix, sep, suffix, cap, limit):
    """Loop reference: build each observation as a Python list."""
    outs = []
    for q in range(rows.shape[0]):
        body, v = [], 0
        for r in rows[q].tolist():
            if r < 0:
                continue
            if v > 0:
                body += sep.tolist()
            body += headers[header_offsets[v]:header_offsets[v + 1]].tolist()
            psg = tokens[offsets[r]:offsets[r + 1]].tolist()
            body += psg if cap is None else psg[:cap]
            v += 1
        if limit is not None:
            body = body[:limit - len(prefix) - len(suffix)]
        outs.append(prefix.tolist() + body + suffix.tolist())
    return outs


def random_store(N, seed, max_len=9):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (N,), generator=g)   # empty passages included
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    tokens = torch.randint(100, 1000, (int(offsets[-1]),), generator=g, dtype=torch.int32)
    return tokens, offsets


def template(K, seed):
    g = torch.Generator().manual_seed(seed)
    hl = torch.randint(1, 4, (K,), generator=g)
    header_offsets = torch.cat([torch.zeros(1, dtype=torch.long), hl.cumsum(0)])
    headers = torch.arange(1, int(header_offsets[-1]) + 1, dtype=torch.int32)
    pieces = dict(prefix=torch.tensor([90, 91, 92], dtype=torch.int32), sep=torch.tensor([93], dtype=torch.int32),
                  suffix=torch.tensor([94, 95], dtype=torch.int32))
    return headers, header_offsets, pieces


def unpacked(out, cu):
    return [out[cu[i]:cu[i + 1]].tolist() for i in range(len(cu) - 1)]


@settings(max_examples=60)
@given(N=st.integers(1, 30), Q=st.integers(0, 7), K=st.integers(1, 6), seed=st.integers(0, 2**16),
       cap=st.one_of(st.none(), st.integers(0, 6)), limit=st.one_of(st.none(), st.integers(5, 40)))
def test_assemble_matches_loop_reference(N, Q, K, seed, cap, limit):
    tokens, offsets = random_store(N, seed)
    g = torch.Generator().manual_seed(seed + 1)
    rows = torch.randint(-1, N, (Q, K), generator=g)            # -1: no passage at that rank
    headers, header_offsets, p = template(K, seed)
    out, cu = assemble_observations(tokens, offsets, rows, headers, header_offsets, **p,
                                    max_passage_tokens=cap, max_obs_tokens=limit)
    assert out.dtype == torch.int32 and cu.dtype == torch.int64 and cu.shape == (Q + 1,)
    assert unpacked(out, cu) == assemble_naive(tokens, offsets, rows, headers, header_offsets, p["prefix"],
                                               p["sep"], p["suffix"], cap, limit)
    if limit is not None:
        assert (cu[1:] - cu[:-1] <= limit).all()


def test_assemble_deterministic_and_errors():
    tokens, offsets = random_store(50, 3)
    rows = torch.randint(0, 50, (37, 5), generator=torch.Generator().manual_seed(0))
    headers, header_offsets, p = template(5, 0)
    first = assemble_observations(tokens, offsets, rows, headers, header_offsets, **p, max_passage_tokens=4)
    for _ in range(3):
        again = assemble_observations(tokens, offsets, rows, headers, header_offsets, **p, max_passage_tokens=4)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    with pytest.raises(ValueError, match="cannot hold the wrappers"):
        assemble_observations(tokens, offsets, rows, headers, header_offsets, **p, max_obs_tokens=4)
    with pytest.raises(ValueError, match="needs 6"):
        assemble_observations(tokens, offsets, rows, headers, header_offsets[:4], **p)
    with pytest.raises(ValueError, match="int32"):
        assemble_observations(tokens.long(), offsets, rows, headers, header_offsets, **p)


def _need_ext():
    """On a GPU machine the extension must have been built (make env builds it): a missing one fails."""
    assert cuda_ext() is not None, \
        f"{cuda_ext_status()} (build it: FASTCREDIT_BUILD_CUDA=1 pip install --no-build-isolation -e .)"


@pytest.mark.gpu
@pytest.mark.parametrize("S,Q,K,k,levels", [(1, 5, 4, 4, 1000), (4, 63, 10, 17, 3), (8, 300, 50, 100, 1000),
                                            (3, 1, 1000, 1000, 7)], ids=lambda x: str(x))
def test_merge_topk_cuda_matches_torch(S, Q, K, k, levels):
    _need_ext()
    scores, ids = random_shards(S, Q, K, levels, S * 1000 + K)
    want = merge_topk(scores, ids, k, impl="torch")
    got = merge_topk(scores.cuda(), ids.cuda(), k, impl="cuda")
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("N,Q,K,cap,limit", [(1, 1, 1, None, None), (1000, 63, 5, 7, 60), (5000, 512, 3, 256, 500),
                                             (40, 17, 10, 0, 12), (300, 1000, 8, None, None)], ids=lambda x: str(x))
def test_assemble_cuda_matches_torch(N, Q, K, cap, limit):
    _need_ext()
    tokens, offsets = random_store(N, N + Q, max_len=300)
    rows = torch.randint(-1, N, (Q, K), generator=torch.Generator().manual_seed(Q))
    headers, header_offsets, p = template(K, K)
    args = (tokens, offsets, rows, headers, header_offsets)
    want = assemble_observations(*args, **p, max_passage_tokens=cap, max_obs_tokens=limit, impl="torch")
    cuda_p = {n: t.cuda() for n, t in p.items()}
    for _ in range(3):  # determinism: the same bytes every time
        got = assemble_observations(*(a.cuda() for a in args), **cuda_p, max_passage_tokens=cap,
                                    max_obs_tokens=limit, impl="cuda")
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
