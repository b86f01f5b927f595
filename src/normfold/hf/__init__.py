"""Hugging Face folders: offline loading, example inputs, folding a folder into a stock-loadable
folded folder with reports, reloading it with fast RMSNorms, and streaming folds of checkpoints
larger than memory. Needs ``pip install 'normfold[hf]'`` (transformers, safetensors)."""
from __future__ import annotations

from .folder import analyze_folder, fold_folder
from .folder_report import FolderReport
from .judge import verify_folders
from .streaming import check_block, fold_checkpoint, verify_by_blocks
from .inputs import example_inputs_for
from .load import CheckpointError, default_model_path, load_model
from .report import read_folder_report
from .saving import from_pretrained, save_folded, save_pretrained
from .sentence_transformers import sentence_transformer
from .side_files import copy_side_files

__all__ = ["CheckpointError", "FolderReport", "analyze_folder", "check_block", "copy_side_files", "default_model_path",
           "example_inputs_for", "fold_checkpoint", "fold_folder", "from_pretrained", "load_model", "read_folder_report",
           "save_folded", "save_pretrained", "sentence_transformer", "verify_by_blocks", "verify_folders"]
