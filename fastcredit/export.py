"""Export a run's training checkpoint as a Hugging Face model folder that transformers and vLLM load.

    python -m fastcredit.export --run runs/demo --out exports/demo                  # the run's latest checkpoint
    python -m fastcredit.export --run runs/x --step 200 --out exports/x-200 --dtype bfloat16
    python -m fastcredit.export --run runs/x --out exports/x --force                # replace an earlier export

The folder holds config.json, model.safetensors (sharded with an index above --max-shard-size),
the tokenizer's files, generation_config.json and fastcredit_source.json (the run, step and dtype, and
the sha256 of the checkpoint's manifest: which save of that step it was). :func:`export_once` reuses
an export only while that record matches the checkpoint as it is now (``python -m fastcredit.eval``
keeps one per step in ``<run>/exports/step_N``): a step saved again with other weights, as a
collapse-guard rollback does, is exported again. An export replaces an earlier one whole, and only
once the new one is complete. The architecture comes from the run itself:
its config.yaml (the merged TrainConfig) builds the policy as the trainer does
(``fastcredit.models.build.load_policy``; the tiny policy's tokenizer is the one in the run
folder), then the checkpoint's policy weights replace the built ones. Both kinds of checkpoint
``fastcredit.distributed.checkpoint`` writes are read in this one process, without a process group, whatever
number of ranks wrote them:

* FSDP2 (``step_N/model/``, DCP): only the keys ``policy.model.lm.<HF name>`` are read (no
  optimizer state); DCP reassembles each full tensor from the ranks' shards, in place in the model.
* DeepSpeed ZeRO-2 / 3 (``step_N/engine/policy/``, one ``zero_pp_rank_*`` pair per rank):
  DeepSpeed's ``zero_to_fp32`` consolidates the fp32 master weights (keys ``lm.<HF name>``) from
  the optimizer partitions, dropping the Adam moments as it reads them.

NOTE: transformers 5 makes ``AutoTokenizer`` build the model type's own tokenizer class for some
types (qwen2 among them) whatever tokenizer_config.json names; ``Qwen2Tokenizer`` then re-splits
text with Qwen's pattern, which the tiny policy's tokenizer was not trained with. The export says
so when it happens; ``fastcredit.data.tokenizer.load_tokenizer`` loads the class the folder names, as the run
tokenized. The work is ``fastcredit.models.export`` (shared with evaluation and labelling).
Token ids given directly (vLLM's ``TokensPrompt``, ``generate(input_ids)``) are unaffected.

Tied weights (LM head and embeddings) stay one tensor; a checkpoint whose two copies differ,
or whose weights do not match the model by name and shape, is refused with the key named.
Exit status: 0 done, 2 bad input (missing run, checkpoint or step; occupied --out; weights that
do not fit the run's model).
"""

from __future__ import annotations

import sys
from typing import Optional

from fastcredit.models.export import DEFAULT_SHARD, DTYPES, ExportError, export_checkpoint


def parser():
    """The command's line: the run, the folder written, and how."""
    from fastcredit.config import command_parser

    p = command_parser("python -m fastcredit.export", __doc__)
    p.add_argument("--run", required=True, metavar="RUN", help="the run folder (logging.output_dir of the training)")
    p.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face folder to write")
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint step (default: checkpoints/latest)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="the weights' dtype")
    p.add_argument("--max-shard-size", default=DEFAULT_SHARD, metavar="SIZE",
                   help="the largest safetensors file; bigger models are sharded with an index")
    p.add_argument("--force", action="store_true", help="replace --out when it holds an earlier export")
    return p


def main(argv: Optional[list] = None) -> int:
    from fastcredit.config import ConfigError

    args = parser().parse_args(argv)
    try:
        export_checkpoint(args.run, args.out, args.step, args.dtype, args.force, args.max_shard_size)
    except (ExportError, ConfigError) as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
