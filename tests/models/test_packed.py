"""The actor's padding-free packed forward equals the padded one, and never builds a [T, T] mask.

The reference is computed here with the plain HF model (sdpa) over right-padded ``[B, L]``
inputs and an attention mask; the packed side is ``fastcredit.models.packed``'s ``[1, T]`` row
through ``fastcredit.models.varlen`` (or flash-attention's varlen path on a GPU).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from fastcredit.distributed.engine import apply_activation_checkpointing
from fastcredit.models import varlen
from fastcredit.models.packed import PolicyModel, ValueModel, model_inputs
from fastcredit.models.tiny import build_tiny_policy
from fastcredit.rollout.trajectory import Turn, from_turns

RESPONSE_LENS = (3, 40, 200)
PROMPT_LENS = (1, 7, 12)


class _Vocab:
    """What build_tiny_policy reads of a tokenizer."""

    eos_token_id, pad_token_id = 1, 0

    def __len__(self):
        return 101


def _tiny(kv_heads=None):
    lm = build_tiny_policy(_Vocab(), hidden=64, layers=2, heads=4, seed=0)
    if kv_heads is not None:  # the same family with grouped-query attention
        from transformers import Qwen2ForCausalLM

        cfg = copy.deepcopy(lm.config)
        cfg.num_key_value_heads = kv_heads
        torch.manual_seed(1)
        lm = Qwen2ForCausalLM(cfg).float().eval()
    return lm


def _batch(response_lens=RESPONSE_LENS, prompt_lens=PROMPT_LENS, seed=0):
    """Trajectories of the given lengths (a search turn with an observation, then an answer) and prompts."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(2, 101, (n,), generator=g).tolist()  # noqa: E731
    trajs = []
    for n in response_lens:
        a = max(n // 3, 1)
        o = max(n // 3, 1) if n - a > 1 else 0
        trajs.append([Turn(tok(a), "search", tok(o)), Turn(tok(n - a - o), "answer")] if n - a - o > 0
                     else [Turn(tok(a), "answer", tok(o))])
    batch = from_turns(trajs, group_id=[0] * len(trajs))
    assert batch.seqlens_B.tolist() == list(response_lens)
    return batch, [tok(p) for p in prompt_lens]


def _padded_ids(prompts, batch):
    """Right-padded ``[B, L]`` ids of ``prompt_b + response_b`` and their attention mask."""
    cu = batch.cu_seqlens.tolist()
    seqs = [p + batch.tokens_N[cu[b]:cu[b + 1]].tolist() for b, p in enumerate(prompts)]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)], mask[b, :len(s)] = torch.tensor(s), 1
    return ids, mask


def _padded(lm, prompts, batch):
    """Right-padded reference: ``(hidden at each response token's predictor [N, H], logits there [N, V])``."""
    ids, mask = _padded_ids(prompts, batch)
    device = lm.get_input_embeddings().weight.device
    hidden = lm.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device),
                              use_cache=False).last_hidden_state
    P, R = [len(p) for p in prompts], batch.seqlens_B.tolist()
    hidden_NH = torch.cat([hidden[b, P[b] - 1:P[b] - 1 + R[b]] for b in range(len(P))])
    return hidden_NH, hidden_NH.float() @ lm.get_output_embeddings().weight.float().T


def _logp_entropy(logits_NV, target_N):
    lp = torch.log_softmax(logits_NV.float(), -1)
    return lp.gather(1, target_N[:, None])[:, 0], -(lp.exp() * lp).sum(-1)


def _pair(kv_heads=None):
    """The same weights twice: a plain HF model (sdpa) for the reference, one for the packed path."""
    lm = _tiny(kv_heads)
    return copy.deepcopy(lm), lm


def test_model_inputs_pack_without_padding():
    batch, prompts = _batch()
    x = model_inputs(prompts, batch, device="cpu")
    lens = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    assert x.input_ids.shape == (1, sum(lens)) and x.num_tokens == sum(lens)
    assert x.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)] and x.max_seqlen == max(lens)
    assert x.position_ids[0].tolist() == [i for n in lens for i in range(n)]
    assert torch.equal(x.input_ids[0, x.pred_N + 1], batch.tokens_N.long())  # the predictor is the token before
    assert x.input_ids[0, :PROMPT_LENS[0]].tolist() == prompts[0]


@pytest.mark.parametrize("kv_heads", [None, 1, 2], ids=["mha", "gqa-1", "gqa-2"])
def test_packed_logprobs_and_entropies_equal_padded(kv_heads):
    ref, lm = _pair(kv_heads)
    batch, prompts = _batch()
    with torch.no_grad():
        want_lp, want_ent = _logp_entropy(_padded(ref, prompts, batch)[1], batch.tokens_N.long())
        lp, ent = PolicyModel(lm, "torch")(model_inputs(prompts, batch, "cpu"))
    assert varlen.attention_impl(lm) == varlen.VARLEN and varlen.attention_impl(ref) == "sdpa"
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)


def test_packed_values_equal_padded():
    ref, lm = _pair(kv_heads=2)
    value = ValueModel(lm)
    torch.nn.init.normal_(value.value_head.weight, std=0.5)
    torch.nn.init.normal_(value.value_head.bias, std=0.5)
    batch, prompts = _batch()
    with torch.no_grad():
        want = value.value_head(_padded(ref, prompts, batch)[0]).squeeze(-1)
        got = value(model_inputs(prompts, batch, "cpu"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _rel_err(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_packed_gradients_equal_padded(checkpointing, monkeypatch):
    from transformers import AttentionInterface

    ref, lm = _pair(kv_heads=2)
    ref.train(), lm.train()
    if checkpointing:
        apply_activation_checkpointing(lm)
    batch, prompts = _batch()
    w = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    lp, ent = _logp_entropy(_padded(ref, prompts, batch)[1], batch.tokens_N.long())
    ((lp * w).sum() + 0.1 * ent.sum()).backward()
    seen = []

    def spy(*a, **kw):  # did the packed bounds reach the attention function?
        seen.append(kw.get("cu_seq_lens_q") is not None)
        return varlen.varlen_attention_forward(*a, **kw)

    varlen.register()
    AttentionInterface.register(varlen.VARLEN, spy)
    try:  # the backward too: checkpointing's recompute calls the attention again
        lp, ent = PolicyModel(lm, "torch")(model_inputs(prompts, batch, "cpu"))
        ((lp * w).sum() + 0.1 * ent.sum()).backward()
    finally:
        AttentionInterface.register(varlen.VARLEN, varlen.varlen_attention_forward)
    # every layer, in the forward and (checkpointing) again in the backward's recompute
    assert seen == [True] * (2 if checkpointing else 1) * lm.config.num_hidden_layers
    got = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in lm.named_parameters()}
    for name, p in ref.named_parameters():
        assert got[name] is not None, name
        assert _rel_err(got[name], p.grad) < 1e-5, (name, _rel_err(got[name], p.grad))


def test_no_square_mask_and_attention_per_sequence(monkeypatch):
    """No [T, T] (or any) mask is built: transformers' mask builders are never reached, and SDPA runs
    once per sequence and layer with is_causal and no mask."""
    from transformers import masking_utils

    def refuse(*a, **kw):
        raise AssertionError("a mask was materialised")

    for name in ("sdpa_mask", "eager_mask", "flash_attention_mask", "flex_attention_mask"):
        monkeypatch.setattr(masking_utils, name, refuse)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[2], attn_mask, kw.get("is_causal")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    lm = _tiny()
    batch, prompts = _batch()
    with torch.no_grad():
        PolicyModel(lm, "torch")(model_inputs(prompts, batch, "cpu"))
    lens = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    assert [c[0] for c in calls] == lens * lm.config.num_hidden_layers
    assert all(mask is None and causal for _, mask, causal in calls)


def test_a_model_set_to_varlen_still_runs_padded_and_generates_like_sdpa():
    """Outside a packed row (a padding mask, a KV cache) the registered backend is sdpa's, so a copy of the
    policy made after its first packed forward (or the rollout engine's copy) is not broken by it."""
    ref, lm = _pair(kv_heads=2)
    batch, prompts = _batch((5, 9), (3, 6))
    with torch.no_grad():
        PolicyModel(lm, "torch")(model_inputs(prompts, batch, "cpu"))
        assert varlen.attention_impl(lm) == varlen.VARLEN
        torch.testing.assert_close(_padded(lm, prompts, batch)[1], _padded(ref, prompts, batch)[1], atol=1e-5, rtol=0)
        ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
        mask = (ids != 0).long()
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(copy.deepcopy(lm).generate(ids, **kw), ref.generate(ids, **kw))


def test_packed_position_ids_alone_bound_the_sequences():
    """A caller passing only packed position ids (no cu_seq_lens) gets per-sequence attention too."""
    _, lm = _pair(kv_heads=2)
    batch, prompts = _batch()
    x = model_inputs(prompts, batch, "cpu")
    with torch.no_grad():
        want = PolicyModel(lm, "torch")(x)[0]
        hidden = lm.get_decoder()(input_ids=x.input_ids, position_ids=x.position_ids, use_cache=False)
        got = _logp_entropy(hidden.last_hidden_state[0][x.pred_N] @ lm.lm_head.weight.T, x.target_N)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("flash", [False, True], ids=["varlen-sdpa-fp32", "flash_attention_2-bf16"])
def test_packed_equals_padded_on_a_gpu(flash):
    """On CUDA: flash-attention's varlen path (bf16) when flash_attn is installed, else the registered
    per-sequence SDPA (fp32); the reference is sdpa over padded inputs on the same device and dtype."""
    import importlib.util

    if flash and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash_attn is not installed")
    dtype = torch.bfloat16 if flash else torch.float32
    ref, lm = (m.to("cuda", dtype) for m in _pair(kv_heads=2))
    batch, prompts = _batch()
    with torch.no_grad():
        x = model_inputs(prompts, batch, "cuda")
        lp, ent = PolicyModel(lm, "torch")(x)
        want_lp, want_ent = _logp_entropy(_padded(ref, prompts, batch)[1], x.target_N)
    assert varlen.attention_impl(lm) == ("flash_attention_2" if flash else varlen.VARLEN)
    if flash:  # bf16 hidden states: rounding differs between the kernels, a wrong mask would not be this close
        assert float((lp - want_lp).abs().mean()) < 2e-2 and float((ent - want_ent).abs().mean()) < 2e-2
        torch.testing.assert_close(lp, want_lp, atol=0.15, rtol=0)
    else:
        torch.testing.assert_close(lp, want_lp, atol=1e-4, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=1e-4, rtol=0)
