#!/usr/bin/env bash
# The engine, trainer and loading tests on the lowest transformers and peft that pyproject.toml allows (or on
# transformers VERSION, with peft's floor):
#   bash scripts/floors.sh [VERSION] [PYTEST ARGS...]
# They (and the huggingface_hub and tokenizers that transformers asks for) go to a folder of their own, put first on
# PYTHONPATH: the project's .venv keeps the newest, which the suite runs on. Needs PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

floor() { sed -n "s/^ *\"$1>=\([0-9.]*\)\",\$/\1/p" pyproject.toml; }
version=${1:-$(floor transformers)}
peft=$(floor peft)
shift || true
[ -n "$version" ] && [ -n "$peft" ] || { echo "floors: no transformers>= or peft>= pin in pyproject.toml" >&2; exit 2; }
target=${XDG_CACHE_HOME:-$HOME/.cache}/agentrl/floor-transformers-$version-peft-$peft
if [ ! -d "$target/peft" ]; then
  .venv/bin/pip install -q --target "$target" "transformers==$version"
  .venv/bin/pip install -q --no-deps --target "$target" "peft==$peft"  # its dependencies (torch) are the venv's
fi
echo "floors: transformers $version and peft $peft from $target"
PYTHONPATH="$target" .venv/bin/python -c "
import peft, transformers
from packaging.version import Version
assert Version(transformers.__version__) == Version('$version'), transformers.__version__
assert Version(peft.__version__) == Version('$peft'), peft.__version__"
PYTHONPATH="$target" exec .venv/bin/pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow" \
  tests/engine tests/train tests/algo tests/test_layers.py tests/test_profiles.py "$@"
