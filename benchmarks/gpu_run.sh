#!/usr/bin/env bash
# The command a lent GPU machine (nvidia-h200: python 3.12, torch 2.11 CUDA, no registry) runs, from the repository
# root: installs the carried wheels and trainer_ext into /tmp/site, then runs benchmarks/gpu_check.py (its arguments
# pass through), its console teed to $OUT/gpu_check_console.txt. First, here: bash benchmarks/gpu_wheels.sh.
#
# The device tool's call (gpu_check's budget is 510 s; installing takes ~30 s):
#   run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=600)
# One step only, e.g.:
#   run(command="bash benchmarks/gpu_run.sh --only env,fp8", carry=[".whl"], timeout_s=300)
set -uo pipefail

die() {
    echo "gpu_run.sh: $*" >&2
    exit 2
}

cd "$(dirname "${BASH_SOURCE[0]}")/.." || die "cannot enter the repository root"
SITE=${GPU_SITE:-/tmp/site} # GPU_SITE: another folder (a trial of this script off the GPU machine)
compgen -G ".whl/*.whl" >/dev/null ||
    die "no .whl/*.whl here: run 'bash benchmarks/gpu_wheels.sh' on the dev machine and name .whl in run's carry"

# every listed wheel travelled (a list edited without rerunning gpu_wheels.sh shows here, not as an ImportError)
while IFS= read -r line || [[ -n $line ]]; do
    line=${line%%#*}
    line=$(echo "$line" | tr -d '[:space:]')
    [[ -z $line ]] && continue
    key=$(echo "${line%%==*}" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g')
    compgen -G ".whl/$key-${line#*==}-*.whl" >/dev/null ||
        die "$line is listed in benchmarks/gpu_wheels.txt but not in .whl/: rerun bash benchmarks/gpu_wheels.sh"
done <benchmarks/gpu_wheels.txt

PIP=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")
# the wheels and trainer_ext itself (its package data, the trainer-ext command; the image has setuptools and wheel) in
# one call: a second --target --upgrade call would replace bin/ whole, dropping the first call's commands
"${PIP[@]}" --no-build-isolation .whl/*.whl . || die "installing .whl/*.whl and trainer_ext into $SITE failed (above)"
# torchao's wheel carries its own tests as a top-level package `test`: on PYTHONPATH it would shadow the stdlib's
if grep -qs '^test/' "$SITE"/torchao-*.dist-info/RECORD; then rm -rf "$SITE/test"; fi

export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH
export DS_BUILD_OPS=0
export PYTHONUNBUFFERED=1

python3 - <<'EOF'
from importlib.metadata import PackageNotFoundError, version

names = ["torch", "transformers", "trainer_ext", "datasets", "evaluate", "deepspeed", "torchao", "pydantic", "pyarrow"]
found = []
for name in names:
    try:
        found.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        found.append(f"{name} MISSING")
print("gpu_run.sh:", ", ".join(found), flush=True)
EOF

if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT"
    python3 benchmarks/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check_console.txt"
else
    python3 benchmarks/gpu_check.py "$@"
fi
