"""The device plugin logs like the other components: a constant message, values in fields
(``extra``), so the JSON lines can be filtered by gpu, path, error, ... (kube_vgpu/jsonlog.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def test_log_calls_put_values_in_fields() -> None:
    bad = []
    for path in sorted((ROOT / "deviceplugin").rglob("*.py")):
        if "api" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "log"):
                continue
            msg = node.args[0] if node.args else None
            constant = isinstance(msg, ast.Constant) or (
                isinstance(msg, ast.IfExp) and isinstance(msg.body, ast.Constant) and isinstance(msg.orelse, ast.Constant))
            if len(node.args) != 1 or not constant:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "log calls formatting values into the message:\n" + "\n".join(bad)
