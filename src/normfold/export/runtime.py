"""Running an exported model in ONNX Runtime: sessions, feeding a call's tensors, and the node types of the
graph ONNX Runtime actually runs (after its own optimizer)."""
from __future__ import annotations

import collections
import json
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .._deps import require

__all__ = ["session", "call_tensors", "run", "optimized_node_counts", "op_times"]


def session(path: str | os.PathLike, *, threads: int = 1, optimized_path: str | os.PathLike | None = None,
            profile_prefix: str | os.PathLike | None = None):
    """An ONNX Runtime CPU session on ``path`` with every graph optimization on (what deployment runs);
    ``optimized_path``: where ONNX Runtime writes the graph it optimized; ``profile_prefix``: profile every
    run into a JSON file of that prefix (``end_profiling()`` returns its name)."""
    ort = require("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only: the exporter's shape hints make it warn on every load
    if profile_prefix is not None:
        options.enable_profiling, options.profile_file_prefix = True, str(profile_prefix)
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
        # weights to a side file: a protobuf cannot hold a model over 2 GB
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         Path(optimized_path).name + ".data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def call_tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors of a call in the order the exporter makes them the graph's inputs (the call's
    pytree leaves; other values are constants of the graph)."""
    return [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)]


def run(sess, args: tuple, kwargs: dict) -> list[Tensor]:
    """The session's outputs on one call, as tensors; ValueError if the call does not match its inputs."""
    tensors = call_tensors(args, kwargs)
    names = [i.name for i in sess.get_inputs()]
    if len(tensors) != len(names):
        raise ValueError(f"the ONNX graph takes {len(names)} inputs ({', '.join(names)}), the call has "
                         f"{len(tensors)} tensors")
    feed = {name: t.detach().cpu().numpy() for name, t in zip(names, tensors)}
    return [torch.from_numpy(out) for out in sess.run(None, feed)]


def optimized_node_counts(path: str | os.PathLike, optimized_path: str | os.PathLike,
                          *, threads: int = 1) -> dict[str, int]:
    """``{op type: count}`` of the graph ONNX Runtime runs for ``path`` (written to ``optimized_path``
    and its ``.data`` side file, read back and removed), main graph only."""
    onnx = require("onnx")
    session(path, threads=threads, optimized_path=optimized_path)
    graph = onnx.load(str(optimized_path), load_external_data=False).graph
    for written in (Path(optimized_path), Path(str(optimized_path) + ".data")):
        written.unlink(missing_ok=True)
    return dict(collections.Counter(node.op_type for node in graph.node))


def op_times(path: str | os.PathLike, feed: dict, *, runs: int, threads: int = 1) -> dict[str, float]:
    """``{op type: seconds per run}`` of the kernels ONNX Runtime runs for ``path`` on ``feed``, from its
    profiler over ``runs`` runs (every run of the session counts, the first too: pass several)."""
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be an int >= 1, got {runs!r}")
    with tempfile.TemporaryDirectory() as folder:
        sess = session(path, threads=threads, profile_prefix=Path(folder) / "ort")
        for _ in range(runs):
            sess.run(None, feed)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    times: collections.Counter = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            times[event["args"]["op_name"]] += event["dur"] * 1e-6 / runs
    return dict(times)
