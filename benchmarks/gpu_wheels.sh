#!/usr/bin/env bash
# Fills .whl/ (git-ignored through .git/info/exclude) with the wheels of benchmarks/gpu_wheels.txt for the GPU
# machine (python 3.12, x86-64 manylinux), so that `run` can carry them: carry [".whl"], then benchmarks/gpu_run.sh.
#
#   . /work/venv/bin/activate && bash benchmarks/gpu_wheels.sh      # here, once; again after editing the list
#
# Idempotent: a wheel already in .whl/ is kept. A package published only as an sdist (deepspeed) is built here into
# a py3-none-any wheel (DS_BUILD_OPS=0, --no-build-isolation: this Python's torch, setuptools and wheel; PYTHON=...
# picks another interpreter). Fails (exit 1, one line saying why) on a download or build error, a wheel in .whl/ that
# the list does not name, or a set too large to travel.
set -euo pipefail

die() {
    echo "gpu_wheels.sh: $*" >&2
    exit 1
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LIST=benchmarks/gpu_wheels.txt
DEST=.whl
PY=${PYTHON:-python3}
MAX_MIB=40 # the tree that travels is capped at 64 MiB, the repository itself ~12 MiB
AIM_MIB=25
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
    manylinux2014_x86_64 manylinux1_x86_64)

[[ -f $LIST ]] || die "$LIST is missing"
command -v "$PY" >/dev/null || die "no $PY here: activate a venv with pip (. /work/venv/bin/activate) or set PYTHON"

# .whl/ must never be committed: ignore it in this clone (once)
EXCLUDE=$(git rev-parse --git-path info/exclude 2>/dev/null) || die "not in a git checkout: run it in the repository"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >>"$EXCLUDE"
mkdir -p "$DEST"

norm() { # a distribution name as wheel file names spell it (PEP 427/503): lower case, runs of -_. as one _
    echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'
}

declare -A WANT=() # normalized name -> version
SPECS=()
while IFS= read -r line || [[ -n $line ]]; do
    line=${line%%#*}
    line=$(echo "$line" | tr -d '[:space:]')
    [[ -z $line ]] && continue
    [[ $line =~ ^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$ ]] ||
        die "$LIST: '$line' is not name==version"
    key=$(norm "${BASH_REMATCH[1]}")
    [[ -z ${WANT[$key]:-} ]] || die "$LIST names ${BASH_REMATCH[1]} twice: keep one version"
    WANT[$key]=${BASH_REMATCH[2]}
    SPECS+=("$line")
done <"$LIST"

have() { # is a wheel of this name and version in .whl/ already?
    compgen -G "$DEST/$1-$2-*.whl" >/dev/null
}

build_sdist() { # name==version published as an sdist only: build a pure-Python wheel here
    local spec=$1 key=$2 tmp wheel
    "$PY" -c 'import setuptools, torch, wheel' 2>/dev/null ||
        die "$spec has no wheel and building it needs torch, setuptools and wheel in $PY (. /work/venv/bin/activate)"
    tmp=$(mktemp -d)
    echo "  $spec: no wheel published, building one from its sdist (DS_BUILD_OPS=0)"
    "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp/src" "$spec" >"$tmp/log" 2>&1 ||
        die "$spec: sdist download failed: $(tail -n 1 "$tmp/log")"
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/out" "$tmp"/src/* >"$tmp/log" 2>&1 ||
        die "$spec: wheel build failed: $(tail -n 1 "$tmp/log")"
    wheel=$(compgen -G "$tmp/out/$key-*-py3-none-any.whl") ||
        die "$spec: the build gave $(ls "$tmp/out") rather than one py3-none-any wheel (it would not fit python 3.12)"
    # the wheel must not pin this machine's torch (the GPU image has its own)
    "$PY" - "$wheel" <<'EOF' || die "$spec: the built wheel pins torch to this machine's build"
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
reqs = [r.split(";")[0] for r in re.findall(r"^Requires-Dist: *(.*)$", meta, re.M)]
pins = [r for r in reqs if re.match(r"torch\b", r) and ("==" in r or "+" in r)]
sys.exit(1 if pins else 0)
EOF
    mv "$wheel" "$DEST/"
    rm -rf "$tmp"
}

for spec in "${SPECS[@]}"; do
    name=${spec%%==*}
    key=$(norm "$name")
    if have "$key" "${WANT[$key]}"; then
        echo "  $spec: already in $DEST/"
        continue
    fi
    args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
    for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
    log=$(mktemp)
    if "$PY" -m pip download -q "${args[@]}" -d "$DEST" "$spec" >"$log" 2>&1; then
        echo "  $spec: downloaded"
    elif grep -q "No matching distribution" "$log"; then
        build_sdist "$spec" "$key"
    else
        die "$spec: download failed: $(grep -v '^WARNING' "$log" | tail -n 1)"
    fi
    rm -f "$log"
    have "$key" "${WANT[$key]}" || die "$spec: no $key-${WANT[$key]}-*.whl in $DEST/ after the download"
done

# exactly the listed wheels travel: a stale or extra one would install beside (or over) the listed one
for f in "$DEST"/*.whl; do
    base=$(basename "$f")
    key=$(norm "${base%%-*}")
    rest=${base#*-}
    [[ -n ${WANT[$key]:-} ]] || die "$f is not in $LIST: remove it"
    [[ ${rest%%-*} == "${WANT[$key]}" ]] || die "$f is not the listed version ${WANT[$key]}: remove it"
done

bytes=$(cat "$DEST"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu_wheels.sh: ${#SPECS[@]} wheels in $DEST/, $mib MiB in all"
awk -v b="$bytes" -v m="$MAX_MIB" 'BEGIN { exit !(b > m * 1048576) }' &&
    die "$DEST/ holds $mib MiB, over $MAX_MIB MiB: it would not travel with the tree (64 MiB in all); carry less"
awk -v b="$bytes" -v m="$AIM_MIB" 'BEGIN { exit !(b > m * 1048576) }' &&
    echo "gpu_wheels.sh: warning: over the $AIM_MIB MiB aimed at" >&2
exit 0
