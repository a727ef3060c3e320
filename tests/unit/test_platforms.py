"""The platforms are objects: no module outside :mod:`true_on_policy.config.platforms` compares a platform
or engine name as a string; ``Settings.platform`` resolves to one object that prints, exports and keys
as its name. The grep has a twin on a synthetic tree showing that it sees a planted compare.

What counts as a compare (read from the AST, every branch): a comparison with ``==``, ``!=``, ``in`` or
``not in`` one of whose operands is a string constant in :data:`NAMES` -- a platform name (cpu, cuda,
ascend, npu) or an engine name (rollout: vllm, sglang; training: fsdp, fsdp2, megatron, torchtitan,
veomni) -- or a tuple / list / set literal holding one. Not counted: a compare whose other operand is an
attribute ``.type`` (``tensor.device.type == "cpu"``: a torch device of a tensor, not the platform).
"""

import ast
from pathlib import Path

import pytest

from true_on_policy.config import platforms
from true_on_policy.config.settings import Settings

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "true_on_policy"
OWNER = PACKAGE / "config" / "platforms.py"
NAMES = frozenset({"cpu", "cuda", "ascend", "npu", "vllm", "sglang", "fsdp", "fsdp2", "megatron", "torchtitan", "veomni"})
OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def _names_in(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES:
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {name for element in node.elts for name in _names_in(element)}
    return set()


def _is_device_type(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "type"


def name_compares(root: Path, owner: Path | None = None) -> list[str]:
    """``path:line: source`` of every platform / engine name compared as a string under ``root``, ``owner`` aside."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if owner is not None and path == owner:
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text, str(path))):
            if not isinstance(node, ast.Compare) or not any(isinstance(op, OPS) for op in node.ops):
                continue
            operands = [node.left, *node.comparators]
            if any(_is_device_type(operand) for operand in operands):
                continue
            if any(_names_in(operand) for operand in operands):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.get_source_segment(text, node)}")
    return found


def test_no_platform_or_engine_name_is_compared_outside_the_platform_objects():
    assert name_compares(PACKAGE, OWNER) == []


def test_the_grep_sees_a_planted_compare(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "rows.py").write_text(
        "def f(settings, r, device, strategy):\n"
        "    if settings.platform == 'ascend':\n"
        "        return 1\n"
        "    if 'vllm' != r.name or strategy in ('fsdp', 'fsdp2'):\n"
        "        return 2\n"
        "    return device.type == 'cpu'  # a tensor's device: not counted\n"
    )
    found = name_compares(package)
    assert [line.split(": ", 1)[0] for line in found] == ["pkg/rows.py:2", "pkg/rows.py:4", "pkg/rows.py:4"]


@pytest.mark.parametrize("name", ["cpu", "cuda", "ascend"])
def test_settings_platform_resolves_to_one_object_that_reads_as_its_name(name):
    settings = Settings(platform=name)
    assert settings.platform is platforms.named(name)
    assert isinstance(settings.platform, platforms.Platform)
    assert str(settings.platform) == name and repr(settings.platform) == repr(name)
    assert Settings.from_json(settings.to_json()).platform is settings.platform
    assert settings.resolved_kernels == ("project" if settings.platform.cpu_backend else "engine")


def test_auto_stays_a_name_until_resolved():
    settings = Settings()
    assert settings.platform == "auto" and not isinstance(settings.platform, platforms.Platform)
    assert settings.on_platform(platforms.CUDA).platform is platforms.CUDA
