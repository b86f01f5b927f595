"""The one plan executor over its two stores: the plan the streaming fold makes for a tiny model of
each kind (Pre-LN GPT-2 with a tied head, OPT, Post-LN BERT, BLOOM, a conv → BatchNorm net, DINOv2's
layer scales) gives bit-identical tensors run over the model's parameters (the module store,
``apply_plan``) and over its checkpoint keys (the checkpoint store, ``CheckpointRewrite``)."""
from __future__ import annotations

import pytest
import torch

from normfold.engine.transform import apply_plan
from normfold.hf.load import load_model
from normfold.hf.streaming.checkpoint import StoredKeys
from normfold.hf.streaming.planning import plan_for_checkpoint
from normfold.hf.streaming.rewrite import CheckpointRewrite

from test_batchnorm_folder import ConvBatchNormConfig, ConvBatchNormModel
from test_batchnorm_folder import _registered  # noqa: F401  (an autouse fixture: the model type for AutoConfig)
from tiny_models import tiny_bloom_config

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def folders(tiny_dirs, tmp_path_factory):
    """name -> a saved tiny model whose γ/β, statistics and layer scales are not constants."""
    root = tmp_path_factory.mktemp("executor")
    dirs = {name: tiny_dirs[name] for name in ("gpt2", "opt", "bert")}
    torch.manual_seed(0)
    bloom = transformers.BloomForCausalLM(tiny_bloom_config())
    conv_bn = ConvBatchNormModel(ConvBatchNormConfig())
    dinov2 = transformers.Dinov2Model(transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2,
                                                                num_attention_heads=4, intermediate_size=64,
                                                                image_size=32, patch_size=8, layerscale_value=0.1))
    for name, model in (("bloom", bloom), ("conv_bn", conv_bn), ("dinov2", dinov2)):
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point():
                    t.uniform_(0.5, 1.5)  # positive: valid running variances too
        dirs[name] = root / name
        if name == "dinov2":  # its tensors under the names the model has (save_pretrained renames some)
            model.config.architectures = [type(model).__name__]
            model.config.save_pretrained(dirs[name])
            safetensors_torch.save_file(model.state_dict(), dirs[name] / "model.safetensors", metadata={"format": "pt"})
        else:
            model.save_pretrained(dirs[name])
    return dirs


# (model, the plan may create parameters the class lacks, the plan sections that must not be empty)
CASES = [("gpt2", False, ("untie", "center", "affine_fold", "swap")),
         ("gpt2", True, ("center", "affine_fold", "swap")),
         ("opt", True, ("center", "affine_fold", "swap")),
         ("bert", True, ("center", "swap")),
         ("bloom", True, ("center", "affine_fold", "swap")),
         ("conv_bn", True, ("batchnorm", "center", "affine_fold", "swap")),
         ("dinov2", True, ("layer_scale", "center", "affine_fold", "swap"))]


@pytest.mark.parametrize("name, stock_loadable, sections", CASES, ids=[f"{c[0]}-stock{c[1]}" for c in CASES])
def test_the_module_store_and_the_checkpoint_store_give_bit_identical_tensors(folders, name, stock_loadable, sections):
    report, skeleton, checkpoint = plan_for_checkpoint(folders[name], stock_loadable=stock_loadable)
    plan = report.plan
    assert all(getattr(plan, section) for section in sections), plan.to_dict()  # a plan with every step kind
    in_memory = apply_plan(load_model(folders[name]), plan).state_dict()
    rewrite = CheckpointRewrite(plan, skeleton, checkpoint, out_dtype=None)
    streamed = {}
    for key in [*checkpoint.meta, *rewrite.new_keys]:
        streamed.update(rewrite.compute(key))
    stored = StoredKeys(skeleton, checkpoint)
    for fqn, tensor in in_memory.items():  # every tensor of the folded model, stored once if tied
        key = fqn if fqn in streamed else stored.key(fqn)
        assert key in streamed, fqn
        assert streamed[key].dtype == tensor.dtype and torch.equal(streamed[key], tensor), fqn
    dropped = streamed.keys() - in_memory.keys() - {stored.key(f) for f in in_memory}
    swapped = {s.path for s in plan.swap if not s.elementwise_affine}
    for key in dropped:  # the checkpoint keeps a swapped norm's γ/β as the identity
        path, _, leaf = key.rpartition(".")
        assert path in swapped and bool((streamed[key] == {"weight": 1.0, "bias": 0.0}[leaf]).all()), key
    changed = [k for k in checkpoint.meta if not torch.equal(streamed[k], checkpoint.read(k))]
    assert len(changed) >= len(plan.center)  # the fold changed the checkpoint: nothing compared vacuously
