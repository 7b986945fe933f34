#!/usr/bin/env bash
# The engine, trainer and loading tests on the lowest transformers that pyproject.toml allows (or on VERSION):
#   bash scripts/transformers_floor.sh [VERSION] [PYTEST ARGS...]
# That transformers (with the huggingface_hub and tokenizers it asks for) goes to a folder of its own, put first on
# PYTHONPATH: the project's .venv keeps the newest, which the suite runs on. Needs PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

floor=$(sed -n 's/^ *"transformers>=\([0-9.]*\)",$/\1/p' pyproject.toml)
version=${1:-$floor}
shift || true
[ -n "$version" ] || { echo "transformers_floor: no transformers>= pin in pyproject.toml" >&2; exit 2; }
target=${XDG_CACHE_HOME:-$HOME/.cache}/agentrl/transformers-$version
if [ ! -d "$target/transformers" ]; then
  .venv/bin/pip install -q --target "$target" "transformers==$version"
fi
echo "transformers_floor: transformers $version from $target"
PYTHONPATH="$target" .venv/bin/python -c "
import transformers
from packaging.version import Version
assert Version(transformers.__version__) == Version('$version'), transformers.__version__"
PYTHONPATH="$target" exec .venv/bin/pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow" \
  tests/engine tests/train tests/algo tests/test_layers.py tests/test_profiles.py "$@"
