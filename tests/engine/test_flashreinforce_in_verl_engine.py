"""FlashREINFORCE's entry point in verl 0.9.1: a fresh interpreter that only imports verl finds the loss and
the advantage estimator in verl's registries (the loss and estimator in-process:
tests/unit/test_flashreinforce_in_verl.py).
"""

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def entry_point_probe(tmp_path_factory):
    """A fresh interpreter with a clean environment that only imports verl and asks its registries."""
    clean_env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TRUE_ON_POLICY_", "VERL_USE_EXTERNAL_"))
    }
    code = (
        "import verl\n"
        "from verl.trainer.ppo.core_algos import get_policy_loss_fn, get_adv_estimator_fn\n"
        "print(get_policy_loss_fn('flashreinforce').__module__)\n"
        "print(get_adv_estimator_fn('flashreinforce').__module__)\n"
    )
    folder = tmp_path_factory.mktemp("entry_point")
    with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", code], env=clean_env, stdout=stdout, stderr=stderr, cwd="/")
    yield process, folder
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.mark.subprocess
def test_plain_import_of_verl_registers_flashreinforce_through_the_entry_point(entry_point_probe):
    process, folder = entry_point_probe
    returncode = process.wait(timeout=180)
    stdout, stderr = (folder / "stdout").read_text(), (folder / "stderr").read_text()
    assert returncode == 0, stderr[-3000:]
    assert stdout.split() == ["true_on_policy.verl_adapter.flashreinforce_registration"] * 2
