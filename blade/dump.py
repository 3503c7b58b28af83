"""What ``Config.dump_dir`` keeps per cluster, beside what the engine compiler writes itself:

    subgraph.txt / subgraph.pt   the cluster's TorchScript subgraph (text; loadable module)
    cluster_<k>.onnx             the backend contract (written by the pipeline)
    plan.txt, engine.cpp, compile_command.txt, compile.log, engine.so, manifest.json   (the compiler;
                                 on a cache hit copied from the cache entry / rebuilt from the
                                 manifest). plan.txt: what the engine compiler's plan stage decided
                                 per IR node (stored or inline, layout, conv epilogues)
    reproduce.sh                 one line that reruns this cluster's compile by hand
"""
from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

from blade.engine import compiler
from blade.engine.driver import BLADE_PKG_DIR

SUBGRAPH_TEXT, SUBGRAPH_MODULE, REPRODUCE = "subgraph.txt", "subgraph.pt", "reproduce.sh"


def write_subgraph(cluster_dir: Path, graph, module_bytes: bytes) -> None:
    (cluster_dir / SUBGRAPH_TEXT).write_text(str(graph))
    if module_bytes:
        (cluster_dir / SUBGRAPH_MODULE).write_bytes(module_bytes)


def write_compile_artifacts(cluster_dir: Path, result, compile_options: dict) -> None:
    """Completes a cluster's dump after its compile (hit, success or failure)."""
    if result.cache_hit:
        _from_cache_entry(cluster_dir, Path(result.log_path), result.manifest)
    onnx_files = sorted(cluster_dir.glob("*.onnx"))
    if not onnx_files:
        return
    options = compiler.resolve_options(compile_options)
    command = (f"PYTHONPATH={shlex.quote(str(Path(BLADE_PKG_DIR).parent))} {shlex.quote(sys.executable)} "
               f"-m blade.engine.compile_main {shlex.quote(str(onnx_files[0]))} "
               f"{shlex.quote(str(cluster_dir / 'reproduced'))} --options {shlex.quote(json.dumps(options))}")
    (cluster_dir / REPRODUCE).write_text(f"# reruns the compile of {cluster_dir.name} into ./reproduced\n{command}\n")


def _from_cache_entry(cluster_dir: Path, entry: Path, manifest) -> None:
    """A cache hit brings engine.so and manifest.json; add the rest the dump promises."""
    for name in ("plan.txt", "engine.cpp"):
        if (entry / name).is_file() and not (cluster_dir / name).is_file():
            shutil.copyfile(entry / name, cluster_dir / name)
    if manifest is not None:
        (cluster_dir / "compile_command.txt").write_text(" ".join(manifest.compile_command) + "\n")
    (cluster_dir / "compile.log").write_text(
        f"cache hit: {entry}\n(the engine was compiled earlier with the command in compile_command.txt; "
        f"reproduce.sh recompiles it)\n")
