"""``python -m kubectl_vgpu <command>``: the ``kubectl-vgpu`` plugin (``kubectl vgpu``)."""

from .main import main

raise SystemExit(main())
