"""The packed forward on a Llama (SmolLM2's architecture: grouped-query attention, tied LM head, RMSNorm, rope
theta 1e5), not only the tiny Qwen2: log-probs, entropies and every gradient equal the padded sdpa reference.

Shapes are SmolLM2-135M's ratios at a tiny size (9 query heads over 3 key/value heads, head_dim 64 → here 6 over 2,
head_dim 16). The rehearsal (configs/rehearsal_smollm2.yaml) trains the real one through this path.
"""
import copy

import pytest
import torch

from fastcredit.distributed.engine import apply_activation_checkpointing
from fastcredit.models import varlen
from fastcredit.models.packed import PolicyModel, ValueModel, model_inputs
from fastcredit.rollout.trajectory import Turn, from_turns

VOCAB = 211
RESPONSE_LENS = (2, 37, 150)
PROMPT_LENS = (1, 11, 5)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def _batch():
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    trajs = []
    for n in RESPONSE_LENS:
        a = max(n // 3, 1)
        trajs.append([Turn(tok(a), "search", tok(n - a - 1)), Turn(tok(1), "answer")] if n > 2
                     else [Turn(tok(n), "answer")])
    batch = from_turns(trajs, group_id=[0] * len(trajs))
    assert batch.seqlens_B.tolist() == list(RESPONSE_LENS)
    return batch, [tok(p) for p in PROMPT_LENS]


def _padded_hidden(lm, prompts, batch):
    """Hidden states at each response token's predictor ``[N, H]`` from right-padded sdpa with a mask."""
    cu = batch.cu_seqlens.tolist()
    seqs = [p + batch.tokens_N[cu[b]:cu[b + 1]].tolist() for b, p in enumerate(prompts)]
    ids = torch.full((len(seqs), max(map(len, seqs))), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :len(s)], mask[b, :len(s)] = torch.tensor(s), 1
    hidden = lm.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    return torch.cat([hidden[b, len(p) - 1:len(p) - 1 + r] for b, (p, r) in
                      enumerate(zip(prompts, batch.seqlens_B.tolist()))])


def _logp_entropy(hidden_NH, lm, target_N):
    lp = torch.log_softmax(hidden_NH @ lm.get_output_embeddings().weight.T, -1)
    return lp.gather(1, target_N[:, None])[:, 0], -(lp.exp() * lp).sum(-1)


def test_llama_packed_logprobs_and_values_equal_padded():
    ref = tiny_llama().eval()
    lm = copy.deepcopy(ref)
    batch, prompts = _batch()
    with torch.no_grad():
        want_lp, want_ent = _logp_entropy(_padded_hidden(ref, prompts, batch), ref, batch.tokens_N.long())
        lp, ent = PolicyModel(lm, "torch")(model_inputs(prompts, batch, "cpu"))
        value = ValueModel(copy.deepcopy(ref))
        torch.nn.init.normal_(value.value_head.weight, std=0.5)
        want_v = value.value_head(_padded_hidden(ref, prompts, batch)).squeeze(-1)
        got_v = value(model_inputs(prompts, batch, "cpu"))
    assert varlen.attention_impl(lm) == varlen.VARLEN
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_v, want_v, atol=1e-5, rtol=0)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_llama_packed_gradients_equal_padded(checkpointing):
    ref = tiny_llama().train()
    lm = copy.deepcopy(ref)
    if checkpointing:
        apply_activation_checkpointing(lm)
    batch, prompts = _batch()
    w = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    lp, ent = _logp_entropy(_padded_hidden(ref, prompts, batch), ref, batch.tokens_N.long())
    ((lp * w).sum() + 0.1 * ent.sum()).backward()
    lp, ent = PolicyModel(lm, "torch")(model_inputs(prompts, batch, "cpu"))
    ((lp * w).sum() + 0.1 * ent.sum()).backward()
    got = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in lm.named_parameters()}
    assert set(got) == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        assert got[name] is not None, name
        err = float((got[name] - p.grad).norm() / p.grad.norm().clamp(min=1e-12))
        assert err < 1e-5, (name, err)
