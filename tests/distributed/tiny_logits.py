"""A tiny Qwen2 policy whose forward maps plain ids to logits, shared by the one-process engine tests.

The forward enters through the module the engine shards (FSDP2's root gathers the embeddings), so it is a
:class:`~fastcredit.models.packed.PolicyModel` with a plain-ids forward instead of the log-prob one.
"""
import torch

from fastcredit.models.packed import PolicyModel


class Logits(PolicyModel):
    def forward(self, ids):
        hidden = self.lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        return self.lm.get_output_embeddings()(hidden)


def tiny_logits_policy(vocab: int, hidden: int) -> Logits:
    """Two layers, two heads, one KV head, untied head; seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    return Logits(Qwen2ForCausalLM(cfg))
