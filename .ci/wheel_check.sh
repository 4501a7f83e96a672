#!/usr/bin/env bash
# The package as a user installs it: a wheel built from this checkout, installed (not editable) into
# a clean venv with the lock's dependencies, answers one `cachesmith ask`, its native kernels
# compiled from the wheel's own sources. Run by `make wheel-check` (TORCH and TORCH_INDEX from the
# Makefile); the packaged model is borrowed from the checkout's cache folder, fetched by `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TORCH:?set by make wheel-check}"
work="$(mktemp -d -t cachesmith-wheel-XXXXXX)"
trap 'rm -rf "$work"' EXIT

.venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$work/dist" .
wheel=("$work"/dist/cachesmith-*.whl)
echo "built ${wheel[0]##*/}"
python3 -m venv "$work/venv"
pip="$work/venv/bin/pip"
"$pip" install -q --no-deps ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH"
"$pip" install -q --no-deps --require-hashes -r requirements.lock
"$pip" install -q --no-deps "${wheel[0]}"
"$pip" check

# a cache folder of its own (so the kernels are built from the wheel), with the packaged model in it
model="$(.venv/bin/cachesmith models path smollm2-135m)"
export CACHESMITH_HOME="$work/home"
mkdir -p "$CACHESMITH_HOME/models"
ln -s "$model" "$CACHESMITH_HOME/models/$(basename "$model")"
printf 'Port Lantern lies at the mouth of the Gray River, north of the salt marshes.\n' > "$work/doc.txt"
cd "$work"  # nothing of the checkout on the path: the installed package answers
"$work/venv/bin/cachesmith" ask --doc doc.txt --question "Where is Port Lantern?" --max-new-tokens 12
"$work/venv/bin/python" - "$work" <<'EOF'
import sys
from pathlib import Path

import cachesmith
from cachesmith.model import native_build

work = Path(sys.argv[1])
installed = Path(cachesmith.__file__).resolve()
assert installed.is_relative_to(work / "venv"), f"cachesmith imported from {installed}, not the wheel's install"
assert native_build.library() is not None, "the native kernels did not build from the wheel's sources"
built = sorted(p.name for p in native_build.cache_dir().glob(f"{native_build.PREFIX}*"))
assert built, f"no native build in {native_build.cache_dir()}"
print(f"wheel check: cachesmith from {installed.parent}, native kernels {built[0]}")
EOF
