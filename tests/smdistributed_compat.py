"""Installing compat/smdistributed-shardpar for a test, without touching the shared virtual environment:
pip-install a copy into a temporary target directory, then start interpreters that add that directory as
a site directory (`site.addsitedir` runs its `.pth` file exactly as site-packages does at start-up)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "compat" / "smdistributed-shardpar"
V1_SCRIPT = REPO / "tests" / "multiproc" / "scripts" / "smp_v1_unedited.py"
# As SageMaker sets them for a model-parallel job (transformers' is_sagemaker_mp_enabled reads both).
SAGEMAKER_ENV = {
    "SM_HP_MP_PARAMETERS": json.dumps({"partitions": 1, "ddp": True, "sharded_data_parallel_degree": 1}),
    "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True}),
}


def install(dest: Path) -> Path:
    """`pip install --no-deps --target` of a copy of the package (building in the copy keeps the checkout
    clean); returns the target directory. shardpar itself comes from the checkout (PYTHONPATH)."""
    source = dest / "src"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = dest / "site"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        target,
        source,
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return target


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without SageMaker's or a launcher's variables, shardpar from the checkout."""
    launcher = ("SM_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def runner(site: Path, dest: Path) -> Path:
    """A file that makes `site` a site directory, then runs argv[1] as __main__ with argv[2:]: torchrun's
    entry point for an unedited script."""
    path = dest / "run_with_compat.py"
    path.write_text(
        f"import runpy, site, sys\nsite.addsitedir({str(site)!r})\n"
        "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    return path
