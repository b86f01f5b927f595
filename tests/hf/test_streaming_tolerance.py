"""The streaming (sharded) check judges each piece by a tolerance measured in the stored dtype.

Each piece run (the model cut to its first blocks, every block) must stay within 2x the error the
original piece itself makes in the stored dtype on the same inputs, plus one rounding; the blocks
run on the original's own stream. With the fixed table (2e-1 in bf16, 5e-2 in fp16) a 1.1x head, a
1.5x MLP weight in the last block or its zeroed attention output passed in a bf16 GPT-2.

Measured here (tiny random models, errors against the failing piece's tolerance): GPT-2 bf16 head
9.9e-2 vs 1.0e-2, last MLP 1.1e-1 vs 1.3e-2, zeroed attention output 2.0e-1 vs 1.3e-2. In the bf16
post-LN BERT a 1.5x MLP weight (3.7e-3) and a zeroed attention output (6.1e-3) in the last layer stay
below that block's own bf16 error (4.2e-3, tolerance 1.2e-2): they cannot be told from bf16 rounding
by running the block, so this file does not pin them (in fp16 both fail, as does the head in bf16); the
tensor-by-tensor weight check catches them (tests/hf/test_streaming_weights.py).
"""
from __future__ import annotations

import shutil

import pytest
import torch

from normfold.cli import EXIT_OK, EXIT_VERIFY_FAILED, main
from normfold.engine import FoldVerificationError
from normfold.engine.verify import OWN_ERROR_MULTIPLE
from normfold.hf import CheckpointError, load_model
from normfold.hf.streaming import Checkpoint, fold_checkpoint, verify_by_blocks

import sealing

safetensors_torch = pytest.importorskip("safetensors.torch")

LAST = 1  # the tiny models have 2 layers
CORRUPTIONS = {  # name -> (tensor per family, factor, the piece whose check must fail)
    "head x1.1": ({"gpt2": "lm_head.weight", "bert": "pooler.dense.weight"}, 1.1, "model cut to its first block"),
    "last MLP weight x1.5": ({"gpt2": f"transformer.h.{LAST}.mlp.c_proj.weight",
                              "bert": f"encoder.layer.{LAST}.output.dense.weight"}, 1.5, "{stack}.1"),
    "last attention output zeroed": ({"gpt2": f"transformer.h.{LAST}.attn.c_proj.weight",
                                      "bert": f"encoder.layer.{LAST}.attention.output.dense.weight"}, 0.0, "{stack}.1"),
}
STACKS = {"gpt2": "transformer.h", "bert": "encoder.layer"}
# below the block's own bf16 error in the post-LN BERT: caught by the weight check, not here (module docstring)
WITHIN_OWN_ERROR = {("bert", "bfloat16", "last MLP weight x1.5"), ("bert", "bfloat16", "last attention output zeroed")}
CORRUPTED_CASES = [(family, dtype, corruption) for family in STACKS for dtype in ("bfloat16", "float16")
                   for corruption in CORRUPTIONS if (family, dtype, corruption) not in WITHIN_OWN_ERROR]


@pytest.fixture(scope="module")
def sharded(tiny_dirs, tmp_path_factory):
    """(family, dtype) -> (the tiny model saved in dtype in ~20 KB shards, its streamed fold), made on first use."""
    root, cache = tmp_path_factory.mktemp("sharded_tolerance"), {}

    def get(family: str, dtype: str):
        if (family, dtype) not in cache:
            src, out = root / f"{family}-{dtype}", root / f"{family}-{dtype}-folded"
            load_model(tiny_dirs[family]).to(getattr(torch, dtype)).save_pretrained(
                src, max_shard_size="20KB", safe_serialization=True)
            assert len(list(src.glob("*.safetensors"))) > 2
            fold_checkpoint(src, out)
            cache[family, dtype] = src, out
        return cache[family, dtype]

    return get


def _corrupt(folded, to, key: str, factor: float):
    """A copy of the folded folder at ``to`` with tensor ``key`` scaled by ``factor`` in its shard."""
    shutil.copytree(folded, to)
    shard = to / Checkpoint(to).file_of[key]
    state = safetensors_torch.load_file(shard)
    state[key] = (state[key].double() * factor).to(state[key].dtype)
    safetensors_torch.save_file(state, shard, metadata={"format": "pt"})
    return to


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_correct_streamed_fold_passes_each_pieces_tolerance_measured_in_its_stored_dtype(sharded, family, dtype):
    src, out = sharded(family, dtype)
    ver = verify_by_blocks(src, out)
    assert ver["ok"] and ver["problems"] == [] and ver["why"] is None and ver["stored_dtype"] == dtype
    pieces = [ver["shell"], *ver["blocks"]]
    assert len(ver["blocks"]) == (2 if family == "gpt2" else 0)  # BERT's layers are unchanged: compared as copies
    unit_roundoff = torch.finfo(getattr(torch, dtype)).eps / 2
    for piece in pieces:
        assert piece["ok"] and piece["own_error"] > 0 and dtype in piece["tolerance_rule"], piece
        assert piece["tolerance"] == pytest.approx(OWN_ERROR_MULTIPLE * piece["own_error"] + unit_roundoff)
        # margin: the shells measured 0.41-1.34x their own error with the elementwise metric (0.14-0.9x relative to the max)
        assert piece["max_rel_error"] < 0.75 * piece["tolerance"], piece
    assert ver["tolerance"] == min(p["tolerance"] for p in pieces)
    assert "closest to its bound" in ver["tolerance_rule"]


@pytest.mark.parametrize("family, dtype, corruption", CORRUPTED_CASES)
def test_a_streamed_fold_corrupted_after_folding_fails_the_piece_that_holds_the_change(sharded, tmp_path, family, dtype,
                                                                                      corruption):
    src, out = sharded(family, dtype)
    names, factor, piece = CORRUPTIONS[corruption]
    bad = _corrupt(out, tmp_path / "bad", names[family], factor)
    ver = verify_by_blocks(src, bad)
    assert not ver["ok"]
    piece = piece.format(stack=STACKS[family])
    failed = [p for p in [ver["shell"], *ver["blocks"]] if not p["ok"]]
    assert [p["block"] for p in failed] == [piece]
    assert failed[0]["max_rel_error"] > failed[0]["tolerance"]
    assert ver["why"].startswith(f"float64 check failed: {piece} relative error") and dtype in ver["why"]


def test_normfold_verify_exits_1_on_a_corrupted_sharded_bfloat16_fold_and_0_on_the_correct_one(sharded, tmp_path,
                                                                                                 capsys):
    src, out = sharded("gpt2", "bfloat16")
    assert main(["verify", str(src), str(out)]) == EXIT_OK
    names, factor, _ = CORRUPTIONS["last MLP weight x1.5"]
    bad = _corrupt(out, tmp_path / "bad", names["gpt2"], factor)
    sealing.reseal(bad)  # past the seal: the block check is one of the problems listed
    capsys.readouterr()
    assert main(["verify", str(src), str(bad)]) == EXIT_VERIFY_FAILED
    assert f"problem: outputs: float64 check failed: transformer.h.{LAST} relative error" in capsys.readouterr().out


@pytest.mark.parametrize("key, factor", [("lm_head.weight", 1.1), (f"transformer.h.{LAST}.attn.c_proj.weight", 0.0)])
def test_a_wrong_streamed_bfloat16_fold_is_refused_and_nothing_is_written(sharded, tmp_path, monkeypatch, key, factor):
    import normfold.hf.streaming as streaming

    src, _ = sharded("gpt2", "bfloat16")
    compute = streaming.CheckpointRewrite.compute

    def wrong(self, k):
        return {name: (v.double() * factor).to(v.dtype) if name == key else v for name, v in compute(self, k).items()}

    monkeypatch.setattr(streaming.CheckpointRewrite, "compute", wrong)
    with pytest.raises(FoldVerificationError, match="nothing was written"):
        fold_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_stored_dtype_the_tolerance_cannot_be_measured_in_is_refused_before_any_check(sharded):
    src, out = sharded("gpt2", "bfloat16")
    with pytest.raises(CheckpointError, match="dtype must be one of float32, float16, bfloat16, got 'float64'"):
        verify_by_blocks(src, out, dtype="float64")


@pytest.fixture(scope="module")
def sharded_minilm_bf16(minilm_dir, tmp_path_factory):
    """The real all-MiniLM-L6-v2 saved in bf16 in 10 MB shards, and its streamed (so verified) fold."""
    root = tmp_path_factory.mktemp("minilm_bf16")
    load_model(minilm_dir).to(torch.bfloat16).save_pretrained(root / "src", max_shard_size="10MB",
                                                              safe_serialization=True)
    fold_checkpoint(root / "src", root / "folded")
    return root / "src", root / "folded"


@pytest.mark.parametrize("key, factor, piece", [
    ("pooler.dense.weight", 1.1, "model cut to its first block"),          # 9.8e-2 vs tolerance 1.4e-2
    ("encoder.layer.5.output.dense.weight", 1.5, "encoder.layer.5"),       # 1.3e-1 vs 1.2e-2
    ("encoder.layer.5.attention.output.dense.weight", 0.0, "encoder.layer.5"),  # 1.6e-1 vs 1.2e-2
])
def test_the_real_minilm_in_bfloat16_shards_fails_each_corruption_of_its_post_ln_layers(sharded_minilm_bf16, tmp_path,
                                                                                       key, factor, piece):
    """Trained weights: unlike the tiny random BERT, the changes are 10-40x the block's own bf16
    error (all three passed the fixed 2e-1)."""
    src, out = sharded_minilm_bf16  # its correct fold passed verify_by_blocks inside fold_checkpoint
    ver = verify_by_blocks(src, _corrupt(out, tmp_path / "bad", key, factor))
    assert not ver["ok"]
    assert [p["block"] for p in [ver["shell"], *ver["blocks"]] if not p["ok"]] == [piece]
