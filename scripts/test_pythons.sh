#!/usr/bin/env bash
# `make test-pythons`: kvtier on the other CPython versions pyproject.toml admits (3.12, 3.13;
# `make test` covers 3.11 whole). For each version found, in parallel:
#   1. a venv of its own, .kvtier/pythons/<version>/venv (git-ignored; kept between local runs
#      and remade when pyproject.toml changes), with kvtier's dependencies except torch, the
#      build requirements and the test tools, all read from pyproject.toml;
#   2. a wheel of kvtier built from a copy of the working tree with CFLAGS=-Werror (a warning in
#      manager/_native.c on that version's headers fails the build), installed without deps;
#   3. the compiled core checked in use: KVTIER_NATIVE=1 imports it or fails, no
#      NativeFallbackWarning;
#   4. the tests that need no torch (TESTS below) on the installed wheel, KVTIER_NATIVE=1.
# Why no torch: PyPI's torch 2.13.0 for cp312/cp313 is the CUDA build (527 MB, and it does not
# import without its several GB of nvidia-* libraries: libcudnn.so.9); the CPU build on this
# machine's disk is cp311 only and the CPU wheel index is out of reach. The worker (every copy,
# the host pools), `kvtier serve` / `kvtier replay` (they start workers) and the engine side
# import torch; the manager's core, scheduler API, plan and the node's wire format and event
# fan-out do not, and those are what run here.
# A version not found: one line; it fails the target under CI=true, so a missing interpreter
# is never a silent pass. KVTIER_PYTHONS="3.12 3.13" (the default) picks the versions.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=${KVTIER_PYTHONS:-"3.12 3.13"}
BASE=.kvtier/pythons
# the torch-free tier: native parity (keys, nodes, loops, the -Werror compile on this version's
# headers), the manager's stateful machines, the core and the scheduler API, the node
# service's wire format and event fan-out, the planner's offline reference
TESTS=(tests/test_native.py tests/test_manager_stateful.py tests/test_keys.py
       tests/test_block_pool.py tests/test_core_owns_flags.py tests/test_scheduler_api.py
       tests/test_node_wire.py tests/test_node_fanout.py tests/test_plan_offline.py)
DEV_TOOLS="pytest pytest-timeout hypothesis"

find_python() {  # the newest pyenv build of version $1, else python$1 on PATH
    local v=$1 found
    found=$(ls -d "$HOME"/.pyenv/versions/"$v".*/bin/python"$v" 2>/dev/null | sort -V | tail -n 1)
    [ -n "$found" ] || found=$(command -v "python$v" || true)
    [ -n "$found" ] && echo "$found"
}

one_version() {  # version, interpreter; output goes to the caller's log
    local v=$1 py=$2 dir=$BASE/$1
    local venv=$dir/venv stamp
    stamp=$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)
    echo "== Python $v: $py ($("$py" -c 'import sys; print(sys.version.split()[0])'))"
    if [ "$(cat "$venv/.installed" 2>/dev/null)" != "$stamp" ]; then
        rm -rf "$venv"
        "$py" -m venv "$venv" || return 1
        # dependencies minus torch, build requirements, the test tools: pyproject.toml's pins
        "$venv/bin/python" - "$DEV_TOOLS" > "$dir/requirements.txt" <<'EOF' || return 1
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
tools = set(sys.argv[1].split())
name = lambda req: re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]
reqs = [r for r in project["project"]["dependencies"] if name(r) != "torch"]
reqs += project["build-system"]["requires"]
reqs += [r for r in project["project"]["optional-dependencies"]["dev"] if name(r) in tools]
print("\n".join(reqs))
EOF
        "$venv/bin/pip" install -q --disable-pip-version-check -r "$dir/requirements.txt" \
            2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
        "$venv/bin/python" -c "import numpy, xxhash, pytest, hypothesis, setuptools" || return 1
        echo "$stamp" > "$venv/.installed"
    fi
    # a wheel from a fresh copy of the tree (no stale build/ folder), every warning an error
    rm -rf "$dir/src" "$dir/dist"
    mkdir -p "$dir/src" "$dir/dist"
    cp -r setup.py pyproject.toml README.md manager worker admin engine integrations "$dir/src/"
    find "$dir/src" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
    CFLAGS="-Werror" "$venv/bin/pip" wheel -v --no-deps --no-build-isolation \
        -w "$dir/dist" "$dir/src" > "$dir/build.log" 2>&1 || { cat "$dir/build.log"; return 1; }
    # setup.py's extension is optional: a failed compile still makes a wheel, without the .so
    grep -E "error:|warning:" "$dir/build.log" | grep -v "byte-compiling is disabled" | head -n 20
    "$venv/bin/pip" install -q --no-deps --force-reinstall "$dir"/dist/kvtier-*.whl || return 1
    (cd "$dir" && KVTIER_NATIVE=1 venv/bin/python -W error -c '
import sys
from kvtier.manager.core import native
assert native.active(), native.UNAVAILABLE
print(f"compiled core in use on {sys.version.split()[0]}: {native._ext.__file__}")
') || { echo "Python $v: the compiled core is not in use (see $dir/build.log)"; return 1; }
    local tmp
    tmp=$(mktemp -d /tmp/kvt.XXXXXX)
    KVTIER_NATIVE=1 KVTIER_HYPOTHESIS_PROFILE=dev \
        KVTIER_TEST_DURATIONS="$dir/test-durations.json" \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -m fast --basetemp="$tmp/t" \
        "${TESTS[@]}"
    local status=$?
    [ $status -ne 0 ] || rm -rf "$tmp"
    return $status
}

mkdir -p "$BASE"
pids=() logs=() status=0
for v in $VERSIONS; do
    py=$(find_python "$v")
    if [ -z "$py" ]; then
        echo "test-pythons: Python $v not found (~/.pyenv/versions/$v.*/bin/python$v or python$v on PATH)$([ -n "${CI:-}" ] && echo ': failing, CI=true')"
        [ -z "${CI:-}" ] || status=1
        continue
    fi
    mkdir -p "$BASE/$v"
    one_version "$v" "$py" > "$BASE/$v/log" 2>&1 &
    pids+=($!) logs+=("$v")
done
for i in "${!pids[@]}"; do
    v=${logs[$i]}
    if wait "${pids[$i]}"; then result=passed; else result=FAILED; status=1; fi
    cat "$BASE/$v/log"
    echo "test-pythons: Python $v $result"
done
exit $status
