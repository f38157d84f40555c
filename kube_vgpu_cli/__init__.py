"""The ``kube-vgpu`` console script: one binary, one subcommand per component (the composition root).

This top-level package is the only code that knows every component; the domain package
(``kube_vgpu``) knows none. Subcommands are resolved lazily (``module:function``), so running one
component never imports another. Each function takes the remaining argv and returns an exit code.
``python -m kube_vgpu_cli <command>`` is the same as ``kube-vgpu <command>``.
"""

from __future__ import annotations

import importlib
import sys

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
}


def shim_path(argv: list[str]) -> int:
    """``kube-vgpu shim-path``: print the built shim's path; 1 if it was not built."""
    from libvgpu.__main__ import main as print_path

    if argv:
        print(f"kube-vgpu shim-path: takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    return print_path()


def _usage() -> str:
    lines = ["usage: kube-vgpu <command> [options]", "", "commands:"]
    for name, (_, desc) in SUBCOMMANDS.items():
        lines.append(f"  {name:<14} {desc}")
    lines.append("")
    lines.append("Run 'kube-vgpu <command> --help' for a command's options.")
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
