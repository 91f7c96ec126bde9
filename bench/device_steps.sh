# Sourced by the bench/gpu_*.sh scripts: the repository root as the working folder, $OUT made, the wheels
# carried in .whl/ installed into /tmp/site, and `step`, which runs one part under its own time limit.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
step() {  # step SECONDS NAME COMMAND...: run with a time limit, log to $OUT/NAME.log
  local limit=$1 name=$2
  shift 2
  echo "=== $name"
  timeout "$limit" "$@" 2>&1 | grep -v "it/s\]\|layer/s\]\|shard/s\]\|shape/s\]" | tee "$OUT/$name.log" | tail -60
}
