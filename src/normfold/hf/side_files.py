"""Side files: everything of the input folder that is not a weight file (tokenizer, generation
config, sentence-transformers modules), copied into the output folder without following links out of
it."""
from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path


# Weight files. At the top of the input folder they hold the model being folded; in subfolders, the
# unfolded model in another format (onnx/, openvino/): never carried over, except with the modules of
# a sentence-transformers pipeline (2_Dense/), which the fold does not touch.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".onnx", ".onnx_data",
                   ".gguf", ".tflite", ".ot", ".npz", ".pb", ".pkl", ".pickle")


def copy_side_files(source_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[dict[str, str]]:
    """Carry every file of ``source_dir`` that is not a weight file over into ``out_dir``, subfolders
    included (tokenizer, generation config, README, sentence-transformers ``modules.json``,
    ``1_Pooling/``, ...), so that the folded folder is as usable as the original.

    Copied: regular files inside ``source_dir``, and, in a Hugging Face hub cache snapshot
    (``models--org--name/snapshots/<rev>/``, whose files are links into the repository's own
    ``blobs/``), links that resolve to a regular file of that ``blobs/`` folder. Skipped and returned
    as ``[{"path", "reason"}]``: other links (even to files inside: ``README.md -> ../secret.txt`` must
    not publish the secret), devices and pipes, hidden folders (``.git``), weight files in subfolders.
    Skipped silently: the top-level
    weights and what the fold writes itself (``config.json``, ``*.index.json``, ``normfold_*``); a
    file already in ``out_dir`` is the fold's own and is kept. Every folder and file is opened relative
    to its parent's descriptor without following links, so a link swapped in meanwhile is refused too,
    and nothing is written outside ``out_dir``.
    """
    skipped: list[dict[str, str]] = []
    blobs = _hub_blobs_folder(Path(source_dir))
    source = _Source(Path(source_dir), _pipeline_module_folders(Path(source_dir), blobs), blobs)
    src_fd = os.open(source_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        dst_fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            _copy_folder(src_fd, dst_fd, "", source, skipped)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
    return skipped


@dataclass(frozen=True)
class _Source:
    """What :func:`copy_side_files` knows of the folder it copies from."""

    root: Path
    pipeline: set[str]       # sentence-transformers module folders (their weights are carried over)
    blobs: Path | None       # the hub cache's blobs/ folder when root is a snapshot of it, else None

    def hub_blob(self, rel_path: str) -> Path | None:
        """The blob a snapshot link points to: a regular file directly in ``blobs``, else None."""
        if self.blobs is None:
            return None
        target = Path(os.path.realpath(self.root / rel_path))
        if target.parent != self.blobs or target.is_symlink() or not target.is_file():
            return None
        return target


def _hub_blobs_folder(source: Path) -> Path | None:
    """``<repo>/blobs`` when ``source`` is ``<repo>/snapshots/<rev>`` of a Hugging Face hub cache."""
    source = Path(os.path.realpath(source))
    blobs = source.parent.parent / "blobs"
    if source.parent.name != "snapshots" or blobs.is_symlink() or not blobs.is_dir():
        return None
    return blobs


def _pipeline_module_folders(source: Path, blobs: Path | None) -> set[str]:
    """The folders of a sentence-transformers pipeline (``modules.json``: ``1_Pooling``, ``2_Dense``, ...)."""
    modules_file = source / "modules.json"
    foreign_link = modules_file.is_symlink() and (blobs is None or Path(os.path.realpath(modules_file)).parent != blobs)
    if foreign_link or not modules_file.is_file():
        return set()
    try:
        paths = {m["path"] for m in json.loads(modules_file.read_text())}
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
        return set()  # not a pipeline normfold can read: carried over as a plain file
    return {p for p in paths if isinstance(p, str) and p and os.sep not in p and "/" not in p and p not in (".", "..")}


def _copy_folder(src_fd: int, dst_fd: int, rel: str, source: _Source, skipped: list[dict[str, str]],
                 keep_weights: bool = False) -> int:
    """Copy the folder at ``src_fd`` into the one at ``dst_fd`` by :func:`copy_side_files`' rules;
    ``rel`` is its path in the source (``""`` at the top). Returns the number of files copied."""
    copied = 0
    with os.scandir(src_fd) as entries:
        names = sorted(entry.name for entry in entries)
    for name in names:
        path = f"{rel}{name}"
        try:
            mode = os.stat(name, dir_fd=src_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:  # removed since the listing
            continue
        blob = source.hub_blob(path) if stat.S_ISLNK(mode) else None
        if stat.S_ISLNK(mode) and blob is None:
            skipped.append({"path": path, "reason": "symbolic link, not followed"})
        elif stat.S_ISDIR(mode):
            if name.startswith("."):
                skipped.append({"path": path + "/", "reason": "hidden folder"})
                continue
            copied += _copy_subfolder(src_fd, dst_fd, name, f"{path}/", source, skipped,
                                      keep_weights or (not rel and name in source.pipeline))
        elif not stat.S_ISREG(mode) and blob is None:
            skipped.append({"path": path, "reason": "not a regular file"})
        elif not rel and (name == "config.json" or name.endswith(".index.json") or name.startswith("normfold_")):
            continue  # written by the fold itself
        elif name.endswith(WEIGHT_SUFFIXES) and not keep_weights:
            if rel:
                skipped.append({"path": path, "reason": "weight file of the unfolded model"})
        elif blob is not None:  # a hub cache snapshot's link to its own blob: the blob's content under this name
            blobs_fd = os.open(blob.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                copied += _copy_file(blobs_fd, dst_fd, name, path, skipped, source_name=blob.name)
            finally:
                os.close(blobs_fd)
        else:
            copied += _copy_file(src_fd, dst_fd, name, path, skipped)
    return copied


def _copy_subfolder(src_fd: int, dst_fd: int, name: str, rel: str, source: _Source,
                    skipped: list[dict[str, str]], keep_weights: bool) -> int:
    """:func:`_copy_folder` into ``name`` under ``dst_fd`` (created here, removed again if left empty)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        sub_src = os.open(name, flags, dir_fd=src_fd)
    except OSError as err:  # replaced by a link or removed since the listing
        skipped.append({"path": rel, "reason": f"not readable: {err.strerror}"})
        return 0
    try:
        created = _make_folder(name, dst_fd)
        sub_dst = os.open(name, flags, dir_fd=dst_fd)
        try:
            copied = _copy_folder(sub_src, sub_dst, rel, source, skipped, keep_weights)
        finally:
            os.close(sub_dst)
        if created and not copied:
            os.rmdir(name, dir_fd=dst_fd)
        return copied
    finally:
        os.close(sub_src)


def _make_folder(name: str, dst_fd: int) -> bool:
    """Create folder ``name`` under ``dst_fd``; False when the fold already made it."""
    try:
        os.mkdir(name, dir_fd=dst_fd)
    except FileExistsError:
        return False
    return True


def _copy_file(src_fd: int, dst_fd: int, name: str, path: str, skipped: list[dict[str, str]],
               source_name: str | None = None) -> int:
    """Copy regular file ``source_name`` (default ``name``) to ``name`` (1) unless it is no longer one,
    or ``out`` already has it (0)."""
    try:  # O_NONBLOCK: a pipe swapped in since the listing must not block the open
        fd = os.open(source_name or name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=src_fd)
    except OSError as err:  # ELOOP: a link swapped in since the listing
        skipped.append({"path": path, "reason": f"not readable: {err.strerror}"})
        return 0
    with open(fd, "rb") as source:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            skipped.append({"path": path, "reason": "not a regular file"})
            return 0
        try:
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=dst_fd)
        except FileExistsError:  # written by the fold (generation_config.json): its own version wins
            return 0
        with open(out, "wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
    return 1
