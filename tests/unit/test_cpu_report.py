"""``python -m true_on_policy cpu-report``: a real run on this CPU names its key, its flags and every op's routes;
``--json`` is JSON alone on stdout even when something else writes there during the report."""

import json

import torch

from true_on_policy.cli import cpu_report
from true_on_policy.kernels import ops, premises


def test_the_report_names_this_cpus_key_and_every_ops_route(capfd):
    assert cpu_report.main(["--json"]) == 0
    report = json.loads(capfd.readouterr().out)
    assert report["goldens_key"] == premises.key() == f"{report['cpu_capability']}_{report['blas_fingerprint']}"
    assert report["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(report["flags"]) == set(premises.CPU_FLAGS) and report["mkl"] == premises.mkl_version()
    assert set(report["probes"]) == {"gemm", "exp", "log", "sqrt", "sincos"}
    assert isinstance(report["goldens"]["held"], bool)  # a checkout: its index is there
    assert set(report["ops"]) == set(ops.SPEC_RESTS_ON) >= set(ops.ROUTES)
    for op, entry in report["ops"].items():
        assert entry["paths"][-1] == {"path": "torch", "allowed": True, "bits_rest_on": list(ops.SPEC_RESTS_ON[op])}
        assert entry["bits_rest_on"] == list(ops.bits_rest_on(op, entry["route"])), op
    assert cpu_report.main([]) == 0
    text = capfd.readouterr().out
    assert f"goldens key  {premises.key()}" in text and "  linear " in text


def test_twin_json_stays_alone_on_stdout_when_the_report_prints(capfd, monkeypatch):
    """What --json guards against: a line printed while the report is made reaches stdout without it."""
    made = cpu_report.report

    def noisy():
        print("a library's line")
        return made()

    monkeypatch.setattr(cpu_report, "report", noisy)
    cpu_report.main(["--json"])
    out = capfd.readouterr()
    assert json.loads(out.out)["goldens_key"] == premises.key() and "a library's line" in out.err
    cpu_report.main([])
    assert "a library's line" in capfd.readouterr().out
