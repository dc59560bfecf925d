"""Issue 30 item 3: compat/smdistributed-shardpar, installed with pip, makes `smdistributed.modelparallel.torch`
shardpar's `smp` for unedited v1 scripts and transformers' SMP branches, and never shadows a real install.

The package is pip-installed once into a temporary directory; each check runs in a fresh interpreter
that adds it as a site directory (tests/smdistributed_compat.py). The 2-rank run is
tests/multiproc/test_smdistributed_compat.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from itertools import pairwise
from pathlib import Path

import pytest

from tests import smdistributed_compat as compat


@pytest.fixture(scope="module")
def site_dir(compat_site: Path) -> Path:
    return compat_site  # the session's install (conftest.py), shared with the 2-rank run


def run_python(site: Path, code: str, *, env: dict[str, str] | None = None, path_first: Path | None = None) -> str:
    """Run `code` in a fresh interpreter where `site` is a site directory, as site-packages is.
    `path_first`: a directory put on sys.path before it (another install of `smdistributed`)."""
    prelude = f"import site, sys\nsite.addsitedir({str(site)!r})\n"
    if path_first is not None:
        prelude += f"sys.path.insert(0, {str(path_first)!r})\n"
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env or compat.clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_the_package_ships_a_finder_not_an_smdistributed_directory(site_dir: Path) -> None:
    assert not (site_dir / "smdistributed").exists()  # nothing a real install's files could collide with
    assert (site_dir / "shardpar_smdistributed.pth").read_text().startswith("import shardpar_smdistributed;")


def test_smdistributed_modelparallel_torch_is_shardpars_api(site_dir: Path) -> None:
    out = run_python(
        site_dir,
        """
        import importlib.util
        assert importlib.util.find_spec("smdistributed") is not None  # transformers' check
        import smdistributed
        # The finder and the two outer packages load neither shardpar nor torch (the .pth runs everywhere).
        assert "shardpar" not in sys.modules and "torch" not in sys.modules, "heavy import at start-up"

        import shardpar
        import smdistributed.modelparallel.torch as smp
        from smdistributed.modelparallel import __version__
        from smdistributed.modelparallel.torch.nn import FusedLayerNorm
        from smdistributed.modelparallel.torch.patches.checkpoint import checkpoint

        assert __version__ == "1.13.0", __version__
        assert smp.init is shardpar.init and smp.step is shardpar.step
        assert smp.DistributedModel is shardpar.DistributedModel
        assert smp.DistributedOptimizer is shardpar.DistributedOptimizer and smp.StepOutput is shardpar.StepOutput
        assert FusedLayerNorm is shardpar.nn.FusedLayerNorm
        assert checkpoint is shardpar.patches.checkpoint.checkpoint
        assert smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2 is (
            shardpar.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2)
        assert set(shardpar.__all__) <= set(smp.__all__)
        # What transformers' Trainer reads beyond shardpar's own names.
        assert isinstance(smp.model.DistributedModel, type)
        assert smp.state.module_manager.translate_functions == []

        smp.init({"sharded_data_parallel_degree": 1})
        assert smp.state.cfg is shardpar.get_config() and smp.rank() == 0 and smp.size() == 1
        smp.shutdown()
        try:
            smp.no_such_name
        except AttributeError as err:
            print("ERR", err)
        for missing in ("smdistributed.dataparallel", "smdistributed.modelparallel.torch.no_such_module"):
            try:
                __import__(missing)
            except ModuleNotFoundError:
                print("MISSING", missing)
        """,
    )
    assert "ERR module 'smdistributed.modelparallel.torch' has no attribute 'no_such_name': it is shardpar." in out
    assert "docs/migration.md" in out
    assert "MISSING smdistributed.dataparallel" in out
    assert "MISSING smdistributed.modelparallel.torch.no_such_module" in out


def fake_install(root: Path, *, modelparallel: bool) -> Path:
    """A stand-in for AWS's package: `smdistributed.modelparallel.torch`, or `smdistributed.dataparallel` alone."""
    package = root
    for part in ["smdistributed", "modelparallel", "torch"] if modelparallel else ["smdistributed", "dataparallel"]:
        package = package / part
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("REAL = True\n")
    return root


def test_a_real_smdistributed_always_wins(site_dir: Path, tmp_path: Path) -> None:
    # Placed after the site directory on sys.path too: a path entry, wherever it is, precedes the finder.
    real = fake_install(tmp_path / "real", modelparallel=True)
    out = run_python(
        site_dir,
        f"""
        sys.path.append({str(real)!r})
        import importlib.util
        import smdistributed.modelparallel.torch as smp
        assert smp.REAL and sys.modules["smdistributed"].REAL, smp
        assert importlib.util.find_spec("smdistributed").origin.startswith({str(real)!r})
        assert "shardpar" not in sys.modules
        print("REAL")
        """,
    )
    assert "REAL" in out


def test_a_real_data_parallel_only_smdistributed_keeps_its_package(site_dir: Path, tmp_path: Path) -> None:
    # AWS's data-parallel library alone installs `smdistributed` without `modelparallel`: its package and
    # `dataparallel` stay the real ones; only the absent `modelparallel` comes from shardpar.
    real = fake_install(tmp_path / "real", modelparallel=False)
    run_python(
        site_dir,
        """
        import smdistributed, smdistributed.dataparallel, shardpar
        import smdistributed.modelparallel.torch as smp
        assert smdistributed.REAL and smdistributed.dataparallel.REAL
        assert smp.init is shardpar.init
        """,
        path_first=real,
    )


@pytest.fixture(scope="module")
def v1_script_result(site_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("v1") / "result"
    argv = [str(compat.V1_SCRIPT), str(out)]
    code = f"import runpy; sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    run_python(site_dir, code, env=compat.clean_env(**compat.SAGEMAKER_ENV))
    return json.loads(Path(f"{out}.0").read_text())


def test_an_unedited_v1_script_trains_with_transformers_smp_helpers(v1_script_result: dict) -> None:
    r = v1_script_result
    assert r["is_sagemaker_mp_enabled"] and r["smp_is_shardpar"]
    assert r["sdp"] == 1  # smp.init() read SM_HP_MP_PARAMETERS
    losses = r["losses"]
    assert all(a > b for a, b in pairwise(losses)), losses  # the optimizer stepped on one fixed batch
    # transformers' smp_forward_backward divides by gradient_accumulation_steps (2) before returning it.
    assert 0 < r["hf_loss"] < losses[-1] / 2 + 0.05, (r["hf_loss"], losses)
    assert r["gathered_rows_are_the_batch"]  # smp_gather: smp.allgather over smp.CommGroup.DP_GROUP


def test_transformers_smp_evaluation_runs(v1_script_result: dict) -> None:
    evaluation = v1_script_result["evaluation"]
    assert "error" not in evaluation, evaluation
    assert evaluation["logits_shape"] == [4, 16, 64] and evaluation["gathered"] == [4, 16]
    assert evaluation["loss"] > 0
