"""kube_vgpu_cli: the kube-vgpu console script dispatcher (the composition root, outside the domain)."""

from __future__ import annotations

import argparse
import ast
import importlib
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest

import kube_vgpu
from kube_vgpu_cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


def test_no_args_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "usage: kube-vgpu" in out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([flag]) == 0
    assert "usage: kube-vgpu" in capsys.readouterr().out


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    cap = capsys.readouterr()
    assert "unknown command 'frobnicate'" in cap.err
    assert "usage: kube-vgpu" in cap.err
    assert cap.out == ""


def test_usage_names_the_signing_key_command(capsys: pytest.CaptureFixture[str]) -> None:
    """install.md and rbac.md run `kube-vgpu certs signing-keys ensure`: the top-level usage says
    where it is, and it is reached through `certs`."""
    assert main(["--help"]) == 0
    assert "certs signing-keys ensure" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["certs", "signing-keys", "ensure", "--help"])
    assert exit_.value.code == 0
    assert "--rotate-after-days" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["certs", "--help"])
    assert exit_.value.code == 0
    assert "certs signing-keys ensure --help" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("flag", ["--version", "version"])
def test_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([flag]) == 0
    assert capsys.readouterr().out.strip() == kube_vgpu.__version__ == "0.1.0"


def test_usage_names_the_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "'kube-vgpu --version'" in capsys.readouterr().out


def test_subcommand_targets_are_module_function() -> None:
    for target, desc in SUBCOMMANDS.values():
        mod, _, func = target.partition(":")
        assert mod and func and desc


def test_dispatch_passes_remaining_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("kvg_fake_cmd")
    fake.main = lambda argv: seen.append(argv) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvg_fake_cmd", fake)
    monkeypatch.setitem(SUBCOMMANDS, "fake", ("kvg_fake_cmd:main", "test"))
    assert main(["fake", "--x", "1"]) == 7
    assert seen == [["--x", "1"]]


def test_every_subcommand_resolves() -> None:
    for name, (target, _) in SUBCOMMANDS.items():
        mod, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(mod), func)), name


@pytest.mark.parametrize("cmd", sorted(SUBCOMMANDS))
def test_every_subcommand_answers_help(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``kube-vgpu <command> --help`` (what the top-level usage tells a newcomer to run) prints that
    command's usage and exits 0, also for a command without options (``shim-path`` once refused it)."""
    rc: int | str | None
    try:
        rc = main([cmd, "--help"])
    except SystemExit as e:  # argparse's --help
        rc = e.code
    assert rc == 0, cmd
    out = capsys.readouterr().out
    assert "usage: kube-vgpu" in out
    # plain text for a terminal: no reStructuredText markup from a docstring (replay's showed ``...``)
    assert "``" not in out and "*arrived*" not in out, out


def test_replay_and_its_old_name_run_the_same_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert SUBCOMMANDS["simulate"][0] == SUBCOMMANDS["replay"][0]
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "offline trace replay" in out and "kubectl vgpu what-if" in out and "alias of replay" in out


def test_python_dash_m_runs_the_dispatcher() -> None:
    r = subprocess.run([sys.executable, "-m", "kube_vgpu_cli", "--version"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == kube_vgpu.__version__
    r = subprocess.run([sys.executable, "-m", "kubectl_vgpu", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: kubectl vgpu")  # the kubectl plugin too


COMPONENTS = {"scheduler", "webhook", "deviceplugin", "certs", "kubectl_vgpu", "replay", "kube_vgpu_cli", "libvgpu"}


def test_the_domain_imports_no_component() -> None:
    found = []
    for path in sorted((ROOT / "kube_vgpu").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in COMPONENTS]
        # dispatch by import string counts too
        found += [f"{path.relative_to(ROOT)}: {c}" for c in COMPONENTS if f'"{c}.' in path.read_text()]
    assert not found, found


def test_check_config_loads_each_file_as_the_components_do(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("apiVersion: kube-vgpu.io/v1\nscheduling: {nodePolicy: fgd-bestfit}\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text("apiVersion: kube-vgpu.io/v1\nscheduling: {nodePolicyy: fgd}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("webhook: {allowDisableControlNamespaces: [Team_A]}\n")
    assert main(["check-config", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: ok\n"
    assert main(["check-config", str(good), str(typo), str(bad), str(tmp_path / "none.yaml")]) == 1
    cap = capsys.readouterr()
    assert cap.out == f"{good}: ok\n"
    assert f"{typo}: config key 'scheduling.nodePolicyy': unknown key; allowed:" in cap.err
    assert f"{bad}: config key 'webhook.allowDisableControlNamespaces': 'Team_A' is not allowed; allowed:" in cap.err
    assert f"{tmp_path / 'none.yaml'}: cannot read: No such file or directory" in cap.err
    typo.write_text("scheduling: [1\n")
    assert main(["check-config", str(typo)]) == 1
    assert capsys.readouterr().err == f"{typo}: not valid YAML: line 2, column 1: expected ',' or ']', but got '<stream end>'\n"
    with pytest.raises(SystemExit) as exit_:
        main(["check-config"])
    assert exit_.value.code == 2


def test_check_config_reads_the_charts_configmap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kubectl get configmap <release>-kube-vgpu-config -o yaml | kube-vgpu check-config -` checks the
    file the chart rendered (data.config.yaml), not the ConfigMap's own keys."""
    cm = tmp_path / "cm.yaml"
    cm.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: kv-kube-vgpu-config}\ndata:\n"
                  "  config.yaml: |\n    apiVersion: kube-vgpu.io/v1\n    devices: {splitCount: 0}\n")
    assert main(["check-config", str(cm)]) == 1
    assert "config key 'devices.splitCount'" in capsys.readouterr().err
    cm.write_text(cm.read_text().replace("splitCount: 0", "splitCount: 4"))
    assert main(["check-config", str(cm)]) == 0


def test_check_config_reports_an_unquoted_impossible_date(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An unquoted time that is no real date is one error line naming the key, not a traceback."""
    f = tmp_path / "config.yaml"
    f.write_text("apiVersion: kube-vgpu.io/v1\nscheduling:\n  adoptUnsignedBefore: 2026-02-30T00:00:00Z\n")
    assert main(["check-config", str(f)]) == 1
    err = capsys.readouterr().err
    assert f"{f}: config key 'scheduling.adoptUnsignedBefore': '2026-02-30T00:00:00Z'" in err


def test_webhook_help_states_every_default() -> None:
    """``kube-vgpu webhook --help`` names the default of every flag that has one (the listener's
    address and port once had no help at all)."""
    from webhook.server import build_parser

    for a in build_parser()._actions:
        if a.option_strings and a.default not in (None, [], argparse.SUPPRESS):
            assert "default" in (a.help or ""), a.option_strings


#: each command's parser (module, function) and the arguments it requires besides the flag under test
_PARSERS = {
    "device-plugin": ("deviceplugin.main", "parser", ["--signing-keys-dir", "/x"]),
    "dra-plugin": ("deviceplugin.dra.main", "parser", []),
    "webhook": ("webhook.server", "build_parser", ["--tls-cert-file", "c", "--tls-key-file", "k"]),
    "scheduler": ("scheduler.server", "build_parser", ["--signing-keys-dir", "/x"]),
}


@pytest.mark.parametrize(("command", "flag", "value", "allowed"), [
    ("device-plugin", "--heartbeat-seconds", "nan", "a number of seconds > 0"),
    ("device-plugin", "--heartbeat-seconds", "0", "a number of seconds > 0"),
    ("device-plugin", "--pending-stale-seconds", "-1", "a number of seconds >= 0"),
    ("device-plugin", "--metrics-port", "70000", "a port 0..65535"),
    ("dra-plugin", "--metrics-port", "1.5", "a port 0..65535"),
    ("webhook", "--port", "70000", "a port 0..65535"),
    ("webhook", "--cert-check-seconds", "nan", "a number of seconds > 0"),
    ("webhook", "--max-body-bytes", "0", "a number of bytes >= 1"),
    ("scheduler", "--port", "70000", "a port 0..65535"),
    ("scheduler", "--metrics-port", "-1", "a port 0..65535"),
    ("scheduler", "--resync-seconds", "nan", "a number of seconds > 0"),
    ("scheduler", "--resync-seconds", "0", "a number of seconds > 0"),
])
def test_numeric_flags_are_checked_at_parse(command: str, flag: str, value: str, allowed: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A bad number is a usage error naming the flag, the value and what is allowed, before anything
    starts (``--heartbeat-seconds nan``, ``--resync-seconds nan`` and ports of 70000 once got through to
    the run)."""
    module, fn, required = _PARSERS[command]
    p = getattr(importlib.import_module(module), fn)()
    with pytest.raises(SystemExit) as ei:
        p.parse_args([flag, value, *required])
    assert ei.value.code == 2
    assert f"argument {flag}: {value!r} is not allowed; allowed: {allowed}" in capsys.readouterr().err


def test_webhook_names_the_certificate_file_it_cannot_read(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A missing certificate was reported as a bare "[Errno 2] No such file or directory"."""
    from webhook.server import main as webhook_main

    key = tmp_path / "tls.key"
    key.write_text("x")
    missing = tmp_path / "tls.crt"
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:  # main() routes the root logger to stderr as JSON: give pytest its handlers back after
        assert webhook_main(["--tls-cert-file", str(missing), "--tls-key-file", str(key), "--port", "0"]) == 1
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert f"--tls-cert-file={str(missing)!r}: cannot read it (No such file or directory)" in err, err


def test_check_config_names_a_configmap_without_the_policy_key(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A ConfigMap lacking data.config.yaml was loaded as a policy file itself ("unknown key 'metadata'")."""
    f = tmp_path / "cm.yaml"
    f.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {config.yml: 'a: b'}\n")
    assert main(["check-config", str(f)]) == 1
    err = capsys.readouterr().err
    assert f"{f}: a ConfigMap without a data.config.yaml policy file (its data keys: config.yml); allowed: " in err
