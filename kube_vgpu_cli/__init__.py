"""The ``kube-vgpu`` console script: one binary, one subcommand per component (the composition root).

This top-level package is the only code that knows every component; the domain package
(``kube_vgpu``) knows none. Subcommands are resolved lazily (``module:function``), so running one
component never imports another. Each function takes the remaining argv and returns an exit code.
``python -m kube_vgpu_cli <command>`` is the same as ``kube-vgpu <command>``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "replay": ("replay.main:main", "offline trace replay: a whole workload under every placement policy "
               "(for one pod on a live cluster: kubectl vgpu what-if)"),
    "simulate": ("replay.main:main", "alias of replay"),
    "scheduler": ("scheduler.server:main", "run the kube-scheduler HTTP extender (filter/prioritize/bind)"),
    "webhook": ("webhook.server:main", "run the mutating admission webhook (HTTPS)"),
    "certs": ("certs.main:main", "create/renew the webhook CA and serving certificate; 'certs signing-keys "
              "ensure': create and rotate the allocation signing keys"),
    "device-plugin": ("deviceplugin.main:main", "run the kubelet device plugin on a GPU node"),
    "dra-plugin": ("deviceplugin.dra.main:main", "run the kubelet DRA plugin on a GPU node (ResourceSlices, "
                   "NodePrepareResources, CDI)"),
    "shim-path": ("kube_vgpu_cli:shim_path", "print the path of the built libvgpu.so shim"),
    "check-config": ("kube_vgpu_cli:check_config", "check policy files (config.yaml, kube-vgpu.io/v1) as every "
                     "component loads them, without starting one"),
}


#: every command line and the argparse parser factory ("module", "function") that declares its flags:
#: the docs are checked against these parsers (tests/test_docs_links.py, tests/test_contracts_complete.py)
PARSERS: dict[str, tuple[str, str]] = {
    "kube-vgpu scheduler": ("scheduler.server", "build_parser"),
    "kube-vgpu webhook": ("webhook.server", "build_parser"),
    "kube-vgpu device-plugin": ("deviceplugin.main", "parser"),
    "kube-vgpu dra-plugin": ("deviceplugin.dra.main", "parser"),
    "kube-vgpu certs": ("certs.main", "build_parser"),
    "kube-vgpu certs signing-keys ensure": ("certs.signing_keys", "build_parser"),
    "kube-vgpu replay": ("replay.main", "_parser"),
    "kube-vgpu check-config": ("kube_vgpu_cli", "check_config_parser"),
    "kubectl vgpu": ("kubectl_vgpu.main", "_parser"),
}


def shim_path(argv: list[str]) -> int:
    """``kube-vgpu shim-path``: print the built shim's path; 1 if it was not built."""
    from libvgpu.__main__ import main as print_path

    if argv in (["-h"], ["--help"]):
        print("usage: kube-vgpu shim-path\n\nPrint the path of the built libvgpu.so shim (exit 1 when it was not "
              "built). Takes no arguments.")
        return 0
    if argv:
        print(f"kube-vgpu shim-path: takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    return print_path()


def check_config_parser() -> argparse.ArgumentParser:
    """The parser of ``kube-vgpu check-config``."""
    ap = argparse.ArgumentParser(
        prog="kube-vgpu check-config",
        description="Load each policy file (the chart's config.yaml, apiVersion kube-vgpu.io/v1) as every "
                    "component does, and print 'FILE: ok' or the error naming the key, the value and what is "
                    "allowed. Exit 0 when every file loads, 1 when one does not.")
    ap.add_argument("files", nargs="+", metavar="FILE",
                    help="a policy file, or a ConfigMap holding one under data.config.yaml ('-' = stdin)")
    return ap


def _policy_text(text: str) -> str:
    """The policy file in ``text``: the text itself, or a ConfigMap's ``data["config.yaml"]`` (as
    ``kubectl get configmap <release>-kube-vgpu-config -o yaml`` prints it). Raises ValueError for a
    ConfigMap without that key (loaded as a policy file, it read as "unknown key 'metadata'")."""
    import yaml

    try:
        doc = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError):  # ValueError: an unquoted time that is no real date
        return text  # the loader reports it, naming where (or the key)
    if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
        data = doc.get("data")
        if isinstance(data, dict) and isinstance(data.get("config.yaml"), str):
            return str(data["config.yaml"])
        keys = ", ".join(sorted(map(str, data))) if isinstance(data, dict) and data else "none"
        raise ValueError(f"a ConfigMap without a data.config.yaml policy file (its data keys: {keys}); allowed: "
                         "the chart's <release>-kube-vgpu-config, or the policy file itself")
    return text


def check_config(argv: list[str]) -> int:
    """``kube-vgpu check-config FILE...``: 0 when every file loads, 1 when one does not (each error
    on stderr), 2 for usage errors (argparse)."""
    from kube_vgpu.config import load_config_text
    from kube_vgpu.errors import ConfigError

    args = check_config_parser().parse_args(argv)
    failed = 0
    for name in args.files:
        try:
            load_config_text(_policy_text(sys.stdin.read() if name == "-" else Path(name).read_text()))
        except OSError as e:
            print(f"{name}: cannot read: {e.strerror or e}", file=sys.stderr)
            failed += 1
        except (ConfigError, ValueError) as e:  # a YAML error included: one line, where and what
            print(f"{name}: {e}", file=sys.stderr)
            failed += 1
        else:
            print(f"{name}: ok")
    return 1 if failed else 0


def _usage() -> str:
    lines = ["usage: kube-vgpu <command> [options]", "", "commands:"]
    for name, (_, desc) in SUBCOMMANDS.items():
        lines.append(f"  {name:<14} {desc}")
    lines.append("")
    lines.append("Run 'kube-vgpu <command> --help' for a command's options, 'kube-vgpu --version' for the version.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns the subcommand's exit code (2 for usage errors)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    cmd = args[0]
    if cmd in ("--version", "version"):
        from kube_vgpu import __version__
        print(__version__)
        return 0
    if cmd not in SUBCOMMANDS:
        print(f"kube-vgpu: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target = SUBCOMMANDS[cmd][0]
    mod_name, func_name = target.split(":")
    mod = importlib.import_module(mod_name)
    rc = getattr(mod, func_name)(args[1:])
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
