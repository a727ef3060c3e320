"""The package works without a checkout: a wheel built from the repository, installed without ``-e``,
composes its configs as ``pkg://true_on_policy.configs`` from a directory outside the checkout."""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = "pkg://true_on_policy.configs"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(a directory outside the checkout, the environment whose only ``true_on_policy`` is the wheel's).

    The wheel is built from a copy of the sources (pip builds in the tree it is given: the repository
    stays untouched); ``python -S`` skips site-packages' ``.pth`` files, so the venv's editable install
    of the checkout is not on the path, and the dependencies come from site-packages after the wheel."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "true_on_policy", source / "true_on_policy", ignore=shutil.ignore_patterns("__pycache__", "*.jsonl"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(source)], check=True, timeout=300)
    (wheel,) = (root / "dist").glob("verl_true_on_policy-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(root / "site"), str(wheel)], check=True, timeout=300)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": f"{root / 'site'}:{sysconfig.get_paths()['purelib']}"}
    env.update({key: os.environ[key] for key in ("TRUE_ON_POLICY_ASSETS", "OMP_NUM_THREADS") if key in os.environ})
    work = root / "elsewhere"
    work.mkdir()
    return work, env


def _python(work: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-S", *args], cwd=work, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.subprocess
def test_the_wheel_holds_the_configs_and_not_the_checkout(installed):
    work, env = installed
    where = _python(work, env, "-c", "import true_on_policy; print(true_on_policy.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(work.parent / "site"), where.stdout
    assert not Path(where.stdout.strip()).is_relative_to(REPO)


@pytest.mark.subprocess
def test_check_on_the_packaged_cpu_tiny_exits_0(installed):
    work, env = installed
    result = _python(work, env, "-m", "true_on_policy", "check", "--config-path", PKG, "--config-name", "cpu_tiny")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "true_on_policy: launch accepted (consistent and verified" in result.stdout + result.stderr


@pytest.mark.subprocess
def test_a_users_config_composes_the_section_from_the_package(installed):
    work, env = installed
    (work / "my_job.yaml").write_text(
        textwrap.dedent(f"""\
            hydra:
              searchpath: [pkg://verl.trainer.config, {PKG}]
            defaults:
              - ppo_trainer
              - common/true_on_policy
              - _self_
            true_on_policy:
              delta: 0.01
            """)
    )
    compose = textwrap.dedent("""\
        from hydra import compose, initialize_config_dir
        with initialize_config_dir(config_dir=".", version_base=None):
            cfg = compose(config_name="my_job")
        print(cfg.true_on_policy.deterministic, cfg.true_on_policy.delta, cfg.algorithm.adv_estimator)
        """).replace('"."', repr(str(work)))
    result = _python(work, env, "-c", compose)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "0.01", "gae"], result.stdout


@pytest.mark.subprocess
def test_check_on_the_packaged_qwen35_35b_a3b_reads_the_shipped_shapes(installed):
    """The shapes (shapes/qwen35_35b_a3b/config.json) are in the wheel: check reads the hybrid model's layers from
    them (the gdn_forward row among the unverified ones), exit 3."""
    work, env = installed
    result = _python(work, env, "-m", "true_on_policy", "check", "--config-path", PKG, "--config-name", "qwen35_35b_a3b_cuda")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "UNVERIFIED vLLM Gated DeltaNet forward (hybrid model) [gdn_forward]" in result.stderr
