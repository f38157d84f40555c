"""Shared pytest configuration. Keep it small: put fixtures in their own module and import them here."""

import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # for `import tests.fakeapi`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fakeapi.fixtures import (  # noqa: E402,F401
    fake,
    fake_core_v1,
    fake_kube_api,
    fake_kube_client,
    fake_kubeconfig,
)
