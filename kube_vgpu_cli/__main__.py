"""``python -m kube_vgpu_cli <command>``: the ``kube-vgpu`` console script."""

from . import main

raise SystemExit(main())
