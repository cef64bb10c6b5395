#!/usr/bin/env bash
# Mutation testing of the pure core with cosmic-ray (CI-optional: not part of .ci/run).
#
# cosmic-ray mutates files in place, so this runs in a throw-away clone with a venv of its own
# (mutmut 3 cannot see this repository's package-dir layout, and it would upgrade click past
# faust's pin). Usage: tests/mutation/run.sh [module ...]   (default: pricing shutter_overhead)
# Prints each module's mutants and survivors; `cr-report --show-diff` in the clone shows them.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
git clone -q "$repo" "$work/repo"
cd "$work/repo"
python3 -m venv .venv
.venv/bin/pip install -q -e . pytest hypothesis cosmic-ray
declare -A tests=(
  [pricing]="tests/unit/test_pricing.py tests/unit/test_accounting.py"
  [shutter_overhead]="tests/unit/test_pricing.py tests/unit/test_calibrated.py"
  [degradation]="tests/unit/test_degradation.py tests/unit/test_accounting.py tests/unit/test_batches.py"
)
for module in "${@:-pricing shutter_overhead}"; do
  for m in $module; do
    cat > "cr_$m.toml" <<TOML
[cosmic-ray]
module-path = "streams/core/$m.py"
timeout = 60.0
excluded-modules = []
test-command = ".venv/bin/python -m pytest -x -q -p no:cacheprovider ${tests[$m]}"

[cosmic-ray.distributor]
name = "local"
TOML
    .venv/bin/cosmic-ray init "cr_$m.toml" "cr_$m.sqlite"
    .venv/bin/cosmic-ray exec "cr_$m.toml" "cr_$m.sqlite"
    echo "== $m"; .venv/bin/cr-report "cr_$m.sqlite" | tail -3
  done
done
echo "clone with the results: $work/repo"
