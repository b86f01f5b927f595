"""`normfold fold DIR` on a tiny folder of each of ~25 model types of the installed transformers:
it folds and verifies (exit 0), or says why in one line (exit 2; exit 1 for a failed verification),
never a traceback; and `normfold analyze DIR` says, norm by norm, what the fold did. The folders are built
offline from each type's default config, shrunk."""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from normfold.cli import main
from normfold.cli._output import print_norm_table
from normfold.hf.inputs import example_inputs_for
from normfold.hf.folder_report import FoldSection, ReportNorm
from normfold.hf.report import norm_rows, read_folder_report, report_rows

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

# int config fields that size a model, and the small value each gets (lists such as hidden_sizes are kept)
SMALL_SIZES = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "dim": 32, "hidden_dim": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "intermediate_size": 64, "ffn_dim": 64, "d_ff": 64, "d_inner": 64, "n_inner": 64, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_key_value_heads": 2, "d_head": 8, "head_dim": 8, "d_kv": 8,
    "image_size": 32, "patch_size": 8, "vocab_size": 99, "max_position_embeddings": 64, "n_positions": 64,
    "max_source_positions": 16, "max_target_positions": 16, "num_mel_bins": 8, "projection_dim": 32,
    "projection_size": 32, "encoder_hidden_size": 32,  # a Q-Former's cross-attention reads the vision width (32)
    # LayoutLMv2/v3's spatial embeddings concatenate 4 coordinate and 2 shape embeddings: 4·4 + 2·8 = 32
    "coordinate_size": 4, "shape_size": 8,
}
TOWERS = ("text_config", "vision_config", "audio_config", "encoder_config", "decoder_config", "qformer_config",
          "high_res_vision_config")

# one per family: Pre-/Post-LN text, encoder-decoders, vision with and without input embeddings,
# channels-first norms, audio (waveform and log-mel), two-tower multimodal, character-level, RMSNorm-only
MODEL_TYPES = [
    "bert", "roberta", "distilbert", "albert", "electra", "deberta-v2", "mpnet", "canine", "funnel", "xlnet",
    "gpt2", "gpt_neo", "opt", "bloom", "xglm", "llama", "bart", "t5",
    "vit", "deit", "convnext", "segformer", "mobilevit",
    "wav2vec2", "whisper", "clip", "siglip",
]


def shrink(config):
    """The config with every size field in SMALL_SIZES set small, in each tower too (returned for chaining)."""
    for name, value in list(vars(config).items()):
        if name in SMALL_SIZES and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            setattr(config, name, SMALL_SIZES[name])
    top = SMALL_SIZES["vocab_size"] - 1
    for name, value in list(vars(config).items()):  # special tokens must stay inside the shrunk vocabulary
        if name.endswith("_token_id") and isinstance(value, int) and value >= SMALL_SIZES["vocab_size"]:
            setattr(config, name, 1)
        elif name.endswith("_token_index") and isinstance(value, int) and value >= SMALL_SIZES["vocab_size"]:
            setattr(config, name, top)  # LLaVA's image token (image_token_id reads it): one id of its own each
            top -= 1
    shrink_grid_pinpoints(config)
    if "image_token_index" in vars(config) and config.image_token_index is None and hasattr(config, "num_query_tokens"):
        config.image_token_index = top  # a Q-Former's query outputs (BLIP-2) take the places of this token
    for tower in TOWERS:
        sub = getattr(config, tower, None)
        if isinstance(sub, transformers.PretrainedConfig):
            shrink(sub)
    shrink_layer_lists(config)
    if isinstance(getattr(config, "vision_output_dim", None), int) and hasattr(config, "intermediate_layers_indices"):
        # Mllama's projector reads the last state and each intermediate one, concatenated
        config.vision_output_dim = config.hidden_size * (len(config.intermediate_layers_indices) + 1)
    return config


def shrink_grid_pinpoints(config) -> None:
    """LLaVA-NeXT's any-resolution layouts (``image_grid_pinpoints``, in pixels, 336 apart) as the one
    layout of a single tile of the shrunk vision tower's ``image_size``: the defaults are no whole
    number of shrunk tiles."""
    vision = getattr(config, "vision_config", None)
    if getattr(config, "image_grid_pinpoints", None) and vision is not None:
        side = SMALL_SIZES["image_size"]
        config.image_grid_pinpoints = [[side, side]]


LAYER_INDEX_LISTS = ("global_attn_indexes", "intermediate_layers_indices", "cross_attention_layers",
                     "vision_feature_layers")


def shrink_layer_lists(config) -> None:
    """Lists of layer indices (SAM's ``global_attn_indexes``, Mllama's intermediate and cross-attention
    layers, VipLLaVA's ``vision_feature_layers`` of its vision tower, negative ones counted from the end)
    kept within the shrunk layers: the last layer where none is left."""
    tower = getattr(config, "vision_config", None)
    for name in LAYER_INDEX_LISTS:
        indices = getattr(config, name, None)
        layers = getattr(tower if name.startswith("vision_") and tower is not None else config, "num_hidden_layers", None)
        if isinstance(layers, int) and isinstance(indices, (list, tuple)) and indices:
            setattr(config, name, [i for i in indices if -layers <= i < layers] or [layers - 1])


# fields a size rule cannot derive: GPT-Neo lists one attention type per layer
CONFIG_OVERRIDES = {"gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2}}


def _bare_model_class(config) -> type:
    mapped = transformers.AutoModel._model_mapping[type(config)]
    return mapped[0] if isinstance(mapped, tuple) else mapped  # Funnel maps to (FunnelModel, FunnelBaseModel)


def _config(model_type: str):
    """The shrunk config naming the bare model, as the saved tiny folders do."""
    config = shrink(transformers.CONFIG_MAPPING[model_type](**CONFIG_OVERRIDES.get(model_type, {})))
    config.architectures = [_bare_model_class(config).__name__]
    return config


@dataclass(frozen=True)
class ZooFold:
    """`normfold fold` run once on the tiny folder of one model type: its exit code and what it printed."""
    folder: Path
    out: Path
    code: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def zoo_fold(tmp_path_factory):
    """``fold(model_type)`` -> its :class:`ZooFold`; each folder is built and folded once for the module's tests
    (skips a type whose shrunk default config builds no model)."""
    root = tmp_path_factory.mktemp("zoo")
    runs: dict[str, ZooFold | str] = {}

    def fold(model_type: str) -> ZooFold:
        if model_type not in runs:
            runs[model_type] = _build_and_fold(model_type, root)
        if isinstance(runs[model_type], str):
            pytest.skip(runs[model_type])
        return runs[model_type]

    return fold


def _build_and_fold(model_type: str, root: Path) -> ZooFold | str:
    """The tiny folder of ``model_type`` folded by the CLI, or why no tiny folder could be built."""
    folder, out = root / model_type, root / f"{model_type}-folded"
    try:
        config = _config(model_type)
        torch.manual_seed(0)
        _bare_model_class(config)(config).save_pretrained(folder)
    except Exception as err:  # noqa: BLE001  a config the size rules cannot shrink consistently
        return f"{model_type}: no tiny model from its shrunk default config ({type(err).__name__}: {err})"
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        patch.setenv("NORMFOLD_PROGRESS", "0")  # stderr holds only what the command says, whatever the environment
        code = main(["fold", str(folder), "-o", str(out)])
    return ZooFold(folder, out, code, stdout.getvalue(), stderr.getvalue())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fold_of_a_tiny_folder_folds_or_says_why_in_one_line(zoo_fold, model_type):
    run = zoo_fold(model_type)
    assert "Traceback" not in run.stderr
    if run.code == 0:
        assert (run.out / "normfold_report.json").is_file()
        return
    assert run.code in (1, 2), run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("normfold: ")]
    assert len(lines) == 1 and lines[0].startswith(("normfold: error: ", "normfold: verification failed")), run.stderr
    assert not run.out.exists()  # nothing published without its proof


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_analyze_says_what_fold_did_for_every_norm(zoo_fold, model_type, capsys):
    """One truth per model: the analysis and the folded folder's report agree on every column of every
    norm (RMSNorm or kept, where γ/β went, the reason), and so do the tables the two commands print; the
    markdown report's headline says whether any γ/β moved."""
    run = zoo_fold(model_type)
    if run.code != 0:
        pytest.skip(f"{model_type}: the fold was refused, so there is no folded report to agree with")
    written = report_rows(read_folder_report(run.out))
    capsys.readouterr()
    assert main(["analyze", str(run.folder), "--json"]) == 0
    analysis = json.loads(capsys.readouterr().out)
    assert written, "a folded report without norms compares nothing"
    analysed = norm_rows(FoldSection(tuple(ReportNorm.from_json(n, "the analysis", "") for n in analysis["norms"])))
    assert analysed == written
    markdown = (run.out / "normfold_report.md").read_text().splitlines()
    headline = next(line for line in markdown if line.startswith("**"))  # says where γ/β went, not what was asked
    assert ("folded into the next linear layers" in headline) == any(row["affine_folded"] for row in written)
    print_norm_table(analysed, analysis["model"]["architecture"])  # what `normfold analyze DIR` prints
    table = capsys.readouterr().out
    assert table.strip() and run.stdout.startswith(table)  # fold prints the same table, then its verification


# ------------------------------------------------------------------------------- example inputs by modality



@pytest.mark.parametrize("model_type", ["llava", "paligemma", "video_llava"])
def test_shrink_keeps_the_image_and_video_tokens_inside_the_vocabulary_each_its_own(model_type):
    config = _config(model_type)
    vocab = config.get_text_config().vocab_size
    tokens = [getattr(config, name) for name in ("image_token_id", "video_token_id") if hasattr(config, name)]
    assert tokens and all(0 <= t < vocab for t in tokens) and len(set(tokens)) == len(tokens)


def test_untie_config_leaves_a_vision_model_without_input_embeddings_as_it_is():
    from normfold.hf.saving import untie_config

    model = transformers.MobileViTModel(_config("mobilevit"))  # get_input_embeddings raises NotImplementedError
    before = model.config.to_dict()
    untie_config(model)
    assert model.config.to_dict() == before
    assert set(example_inputs_for(model)) == {"pixel_values"}


def test_a_two_tower_model_gets_token_ids_and_pixels_from_each_tower_config():
    config = _config("siglip")
    inputs = example_inputs_for(config)
    assert inputs["pixel_values"].shape[-1] == config.vision_config.image_size
    assert int(inputs["input_ids"].max()) < config.text_config.vocab_size


def test_a_waveform_model_gets_enough_samples_for_its_feature_encoder():
    config = _config("wav2vec2")
    model = transformers.AutoModel.from_config(config).eval()
    inputs = example_inputs_for(model, seq=4)
    with torch.no_grad():
        assert model(**inputs).last_hidden_state.shape[1] == 4  # the conv stack's inverse, exactly


def test_a_log_mel_model_gets_features_of_twice_its_source_positions_and_decoder_ids():
    inputs = example_inputs_for(_config("whisper"))
    assert inputs["input_features"].shape[1:] == (8, 32) and "decoder_input_ids" in inputs


def test_token_ids_of_a_model_without_vocab_size_or_with_unbounded_positions_are_valid():
    assert example_inputs_for(_config("canine"), seq=16)["input_ids"].shape == (2, 16)  # no vocab_size: characters
    assert example_inputs_for(_config("xlnet"), seq=16)["input_ids"].shape == (2, 16)  # max_position_embeddings = -1


def test_a_config_with_several_heads_per_type_resolves_to_a_class():
    config = _config("deit")
    config.architectures = ["DeiTForImageClassificationWithTeacher"]
    assert "pixel_values" in example_inputs_for(config)


def test_a_forward_without_any_known_input_is_refused_naming_the_inputs():
    from normfold.hf.load import CheckpointError

    class NoKnownInputs(torch.nn.Module):
        config = transformers.BertConfig()

        def forward(self, mystery):
            return mystery

    with pytest.raises(CheckpointError, match="input_ids, pixel_values, input_values, input_features"):
        example_inputs_for(NoKnownInputs())


# ------------------------------------------------------------------------- the command's last boundary

def _fail_unexpectedly(*_args):
    raise RuntimeError("value cannot be converted to type float without overflow\n  second line")


@pytest.mark.parametrize("command", ["analyze", "fold"])
def test_an_unexpected_engine_error_is_one_line_with_exit_2_naming_the_command(tiny_dirs, tmp_path, monkeypatch,
                                                                                capsys, command):
    monkeypatch.setattr("normfold.hf.folder.example_calls_for", _fail_unexpectedly)
    argv = [command, str(tiny_dirs["gpt2"])] + (["-o", str(tmp_path / "out")] if command == "fold" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [
        f"normfold: error: {command} cannot handle this model: RuntimeError: value cannot be converted to type float "
        f"without overflow (not a known refusal; NORMFOLD_TRACEBACK=1 shows the traceback)"]
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv("NORMFOLD_TRACEBACK", "1")  # for a bug report: the error with its traceback
    with pytest.raises(RuntimeError, match="without overflow"):
        main(argv)
