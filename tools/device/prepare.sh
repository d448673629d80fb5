#!/usr/bin/env bash
# Prepares what the device machine lacks for `python -m tools.gpu_check`, on this machine (it has PyPI):
# the wheels of pydantic and its needs for the device's Python (CPython 3.12, x86-64 manylinux), at the
# versions of this checkout's .venv, into tools/device/wheels/ (git-ignored by a .gitignore written there;
# the device tool's `run` carries it). Everything else the check needs (torch, transformers, safetensors)
# is on the device already. Run once before the device call: bash tools/device/prepare.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
wheels="$here/wheels"
mkdir -p "$wheels"
echo '*' > "$wheels/.gitignore"  # nothing in it is committed, this file included
rm -f "$wheels"/*.whl            # one version of each: two stop the whole install there

# pydantic and everything it requires; typing-extensions too, since pydantic-core needs a newer one
# than the device may hold
packages=(pydantic pydantic-core annotated-types typing-inspection typing-extensions)
pins=()
for name in "${packages[@]}"; do
    pins+=("$name==$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$wheels" "${pins[@]}"
ls -l "$wheels"/*.whl
du -ch "$wheels"/*.whl | tail -1
