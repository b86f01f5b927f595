"""Fold safetensors checkpoints larger than memory.

1. Plan: build the model from its config with uninitialised storage (``to_empty``: the pages are
   never touched, so a 13 GB model costs no resident memory), read the norms' γ/β from the files
   (the analysis looks at β), and run the fold engine's analysis. ``torch.export`` traces with fake
   tensors, so it never reads the weights either.
2. Rewrite: every tensor of the plan is read from its shard (``safe_open``, one tensor at a time),
   rewritten with the pure functions of ``normfold.engine.math`` and streamed into new shards by a
   writer that needs only one tensor in memory. Tensors that a step ties together (a weight and
   its bias, an untied copy and its source) are processed as one group; the norms' γ/β, which
   affine folding needs across shards, are read first. All of it goes into a locked temporary
   sibling of the output folder.
3. Verify, piece by piece in float64 (:func:`verify_by_blocks`): every block of the stacks the
   fold touched, the model cut to one block per stack (embeddings, final norm, head), and every
   other tensor as a copy. ``normfold verify`` also re-makes the folder from the original (into a
   temporary folder) and compares every stored tensor with it (``normfold.hf.judge``).
4. Publish: only a verified folder replaces the output, in one atomic exchange.

Peak memory: the largest group in float32 plus the γ/β of all norms while rewriting; while
verifying, the model without all but one block per stack in float64, then one block at a time.

A step after the fold (``rewrite.AfterFold``; ``normfold rotate``: t ↦ t·Q) rewrites the folded
tensors it names in step 2, and step 3 then compares every piece with the original's stream mapped
by it (x ↦ x·Q); the caller composes it, as hf never imports ``rotate``.
"""

from __future__ import annotations

# One module a step: checkpoint (reading and writing safetensors one tensor at a time), planning (1),
# rewrite (2), blocks and verification (3), publish (the whole fold: 1-4).
from .blocks import check_block, check_shell
from ..weight_files import SAFE_INDEX as INDEX
from .checkpoint import Checkpoint, is_sharded, stored_dtype_name, write_safetensors
from .planning import plan_for_checkpoint
from .publish import fold_checkpoint
from .rewrite import CheckpointRewrite
from .verification import verify_by_blocks

__all__ = ["INDEX", "Checkpoint", "CheckpointRewrite", "check_block", "check_shell",
           "fold_checkpoint", "is_sharded", "plan_for_checkpoint", "stored_dtype_name",
           "verify_by_blocks", "write_safetensors"]
