#!/usr/bin/env bash
# Wheels for scripts/gpu-check.sh on a GPU machine that reaches no package index.
#
#   bash scripts/gpu-wheels.sh [DIR]        # default DIR: .whl (git-ignored)
#   KVTIER_WHEELS=.whl bash scripts/gpu-check.sh   # there
#
# What it downloads: kvtier's runtime and test dependencies (pyproject.toml) except torch, as
# binary wheels for the GPU machine's Python (GPU_PYTHON_VERSION, default 3.12: the lent
# machines' image holds CPython 3.12 with a CUDA build of torch), resolved together so the
# versions fit each other and pyproject's ranges. Wheels of packages that image already holds
# are dropped (GPU_IMAGE_HAS, names as pip normalises them), so what travels stays small: the
# device tool carries at most 64 MiB of working tree. Exit 1 when a wheel is missing for that
# platform or the folder is over GPU_WHEELS_MAX_MIB.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYV=${GPU_PYTHON_VERSION:-3.12}
MAX_MIB=${GPU_WHEELS_MAX_MIB:-48}
# On the lent machines' image (the device tool's KINDS.md, read 2026-11-17); kept in the
# download only where pyproject's range needs another version than the image's.
IMAGE_HAS=${GPU_IMAGE_HAS:-"numpy xxhash prometheus-client rich matplotlib contourpy cycler \
fonttools kiwisolver pillow pyparsing python-dateutil six packaging pytest pluggy iniconfig \
pytest-timeout hypothesis sortedcontainers attrs httpx httpcore h11 anyio idna certifi \
sniffio pyyaml typing-extensions markdown-it-py mdurl pygments transformers tokenizers \
safetensors huggingface-hub hf-xet filelock fsspec regex requests urllib3 charset-normalizer \
tqdm jinja2 markupsafe click"}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
reqs=$("$PY" - <<'PYEOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
# schemathesis and import-linter/mypy/ruff are lint/API-fuzz tools: gpu-check runs neither
skip = ("torch", "schemathesis", "ruff", "mypy", "import-linter")
reqs = p["dependencies"] + p["optional-dependencies"]["dev"]
print("\n".join(r for r in reqs if not r.replace(" ", "").startswith(skip)))
PYEOF
)
mapfile -t req_list <<<"$reqs"
platforms=()
for n in 39 35 34 31 28 27 24 17 12 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp \
  "${platforms[@]}" -d "$DIR" "${req_list[@]}"
# drop what the image holds; keep kvtier's own pins where the image's version may not fit
for name in $IMAGE_HAS; do
  stem=${name//-/_}
  case "$name" in transformers) continue ;; esac  # pinned: the real-model test's exact version
  rm -f "$DIR"/"$stem"-[0-9]*.whl "$DIR"/"${stem^}"-[0-9]*.whl
done
# redis-server and redis-cli (the Redis Cluster cases create the cluster with it) for the
# Redis-backed storage tests: the GPU image has neither and nothing can be installed there.
# This machine's binaries travel with the shared libraries they need beyond the C library
# (ldd), each behind a wrapper that points only that program at them (Python there keeps the
# image's own libssl and libstdc++). GPU_REDIS=0 leaves them out.
if [ "${GPU_REDIS:-1}" != 0 ] && command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
  rm -rf "$DIR/redis" && mkdir -p "$DIR/redis/bin" "$DIR/redis/lib"
  for prog in redis-server redis-cli; do
    real=$(readlink -f "$(command -v "$prog")")
    cp "$real" "$DIR/redis/lib/$prog.bin"
    ldd "$real" | awk '/=> \// {print $3}' | while read -r lib; do
      case "$(basename "$lib")" in libc.so.*|libm.so.*|ld-linux*) ;; *) cp -n "$lib" "$DIR/redis/lib/" ;; esac
    done
    cat >"$DIR/redis/bin/$prog" <<SH
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")/../lib
LD_LIBRARY_PATH="\$here" exec "\$here/$prog.bin" "\$@"
SH
    chmod +x "$DIR/redis/bin/$prog"
    "$DIR/redis/bin/$prog" --version >/dev/null || { echo "gpu-wheels: bundled $prog does not run" >&2; exit 1; }
  done
fi
mib=$(du -sm "$DIR" | cut -f1)
echo "gpu-wheels: $(ls "$DIR"/*.whl | wc -l) wheels, ${mib} MiB in $DIR (python $PYV)"
if [ "$mib" -gt "$MAX_MIB" ]; then
  echo "gpu-wheels: $DIR is ${mib} MiB, over GPU_WHEELS_MAX_MIB=$MAX_MIB (the device tool carries 64 MiB)" >&2
  exit 1
fi
