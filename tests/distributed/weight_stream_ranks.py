"""Under torchrun: rank 0 streams a tiny Qwen2's weights (bf16, small buckets) to the other ranks' HF engines;
then a stream whose iterator fails part-way. Writes OUT/rank{r}.pt with what each rank saw.

    torchrun --standalone --nproc_per_node=3 tests/distributed/weight_stream_ranks.py OUT
"""
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from fastcredit.distributed.process_group import exit_process, init_distributed, shutdown
from fastcredit.distributed.weight_stream import WeightStreamError, recv_weights, send_weights
from fastcredit.rollout.engines.hf import HFEngine


def tiny(seed):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def extras():
    # a 0-dim tensor, an empty one and an fp32 one after the bf16 weights: the byte offsets must stay aligned
    return [("scalar", torch.tensor(3.5, dtype=torch.bfloat16)), ("empty", torch.zeros(0, 4, dtype=torch.bfloat16)),
            ("fp32", torch.arange(7, dtype=torch.float32))]


def failing():
    yield "a", torch.ones(3)
    yield "b", torch.ones(5)
    raise ValueError("the trainer's shard gather failed")


def main(out):
    info = init_distributed()
    rank, result = info.rank, {}
    sender = tiny(0)
    if rank == 0:
        named = [(k, v.to(torch.bfloat16)) for k, v in sender.state_dict().items()]
        result["sent"] = send_weights(iter(named + extras()), 5, src=0, bucket_bytes=4096)
        try:
            send_weights(failing(), 6, src=0, bucket_bytes=16)  # "a" goes out in a bucket of its own first
        except ValueError as exc:
            result["sender_error"] = str(exc)
    else:
        engine = HFEngine(tiny(rank).to(torch.bfloat16), SimpleNamespace(pad_token_id=0), "cpu")
        version, named = recv_weights(src=0)
        own, rest = set(engine.model.state_dict()), {}

        def model_part():
            for name, t in named:
                if name in own:
                    yield name, t
                else:
                    rest[name] = t.clone()

        engine.update_weights(model_part())
        engine.weights_version = version
        want = {k: v.to(torch.bfloat16) for k, v in sender.state_dict().items()}
        got = engine.model.state_dict()
        result["equal"] = all(torch.equal(got[k], want[k]) for k in want)
        result["version"] = engine.weights_version
        result["rest"], result["model_tensors"] = rest, len(want)
        version, named = recv_weights(src=0)  # the first bucket arrives whole
        result["before_error"] = []
        try:
            for name, _ in named:
                result["before_error"].append(name)
        except WeightStreamError as exc:
            result["receiver_error"] = str(exc)
    dist.barrier()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    shutdown(info)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)
