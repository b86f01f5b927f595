"""``normfold rotate`` on a sharded tiny Llama folder (issue 32 item 2): the LlamaRMSNorms recognised
by the streaming fold's planning, γ folded into the readers (a tied head untied for it), the stream
rotated tensor by tensor and proved block by block; ``normfold verify`` passes on the folder, and
``normfold.from_pretrained`` loads the same tensors as the in-memory ``normfold.rotate``, computing
the original's logits on fresh inputs of another shape."""
from __future__ import annotations

import json

import pytest
import torch

import normfold
from normfold.cli import EXIT_OK, main
from normfold.hf.inputs import example_inputs_for
from normfold.hf.load import load_model
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.streaming import INDEX
from normfold.nn import RMSNorm
from tiny_models import tiny_rms_lm

pytest.importorskip("rich")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sharded_llama_rotates_verifies_and_reloads_to_the_in_memory_rotation(tmp_path, capsys, tied):
    source, out = tmp_path / "llama", tmp_path / "out"
    original = tiny_rms_lm("llama", tie_word_embeddings=tied)
    original.save_pretrained(source, max_shard_size="20KB", safe_serialization=True)
    assert (source / INDEX).is_file()  # sharded: rotated tensor by tensor
    assert main(["rotate", str(source), "-o", str(out), "--method", "random", "--seed", "3"]) == EXIT_OK
    report = json.loads((out / REPORT_JSON).read_text())
    assert report["verification"]["ok"] and report["rotation"]["streams"][0]["identity_distance"] > 0.1
    assert all("LlamaRMSNorm recognised as an RMSNorm" in n["reason"] for n in report["norms"])
    assert any("lm_head.weight (copy of model.embed_tokens.weight" in u for u in report["untied"]) == tied
    capsys.readouterr()
    assert main(["verify", str(source), str(out)]) == EXIT_OK
    reloaded = normfold.from_pretrained(out)
    assert isinstance(reloaded.model.norm, RMSNorm) and reloaded.model.norm.weight is None
    loaded = load_model(source)
    in_memory, _ = normfold.rotate(loaded, example_inputs_for(loaded), method="random", seed=3)
    expected, got = in_memory.state_dict(), reloaded.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.allclose(expected[key], got[key], rtol=0, atol=1e-6), key
    ids = torch.randint(3, 96, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = original(input_ids=ids, use_cache=False).logits
        assert torch.allclose(reloaded(input_ids=ids, use_cache=False).logits, want, atol=1e-5)
