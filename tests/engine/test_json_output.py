"""``--json`` prints JSON alone on stdout (logs to stderr), checked by parsing the whole of stdout.

``logdiff --engine vllm --json`` (vLLM's logger and engine-core process write to stdout) is checked
in tests/engine/test_vllm_logdiff.py::test_logdiff_cli_on_a_checkpoint_directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from true_on_policy.cli.json_output import stdout_to_stderr

REPO = Path(__file__).resolve().parents[2]
CHILD = [sys.executable, "-c", "import sys; print('from a child process'); sys.stdout.flush()"]


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.subprocess
def test_stdout_to_stderr_moves_python_and_child_process_output(capfd, enabled):
    with stdout_to_stderr(enabled):
        print("from python")
        subprocess.run(CHILD, check=True)
    print('{"the": "json"}')
    out, err = capfd.readouterr()
    if enabled:
        assert json.loads(out) == {"the": "json"}
        assert "from python" in err and "from a child process" in err
    else:  # the twin: without it the noise is on stdout and stdout does not parse
        assert "from python" in out and "from a child process" in out
        with pytest.raises(json.JSONDecodeError):
            json.loads(out)


@pytest.mark.parametrize(
    ("config", "overrides", "code"),
    [
        ("cpu_tiny", [], 0),
        ("cpu_tiny", ["actor_rollout_ref.rollout.n=2"], 2),
        ("qwen3_30b_a3b_cuda", [], 3),
    ],
)
@pytest.mark.subprocess
def test_check_json_is_the_whole_of_stdout(config, overrides, code):
    result = subprocess.run(
        [sys.executable, "-m", "true_on_policy", "check", "--config-path", str(REPO / "configs"), "--config-name", config,
         "--json", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    verdict = json.loads(result.stdout)
    assert result.returncode == verdict["code"] == code, result.stderr[-2000:]
    assert result.stderr.strip().endswith(verdict["lines"][-1])  # the verdict's text, on stderr
    assert verdict["lines"][0].startswith("true_on_policy: ") and verdict["contract"]["rows"]
