#!/usr/bin/env bash
# Regenerate the pinned plans (run from the repository root: `make golden`), then review the
# diff: a change here is a change of schedule that users will see.
set -euo pipefail
cd "$(dirname "$0")"
cli="${MEGATRON_PRT:-megatron-prt}"
while read -r name flags; do
  [ -z "$name" ] || [ "${name:0:1}" = "#" ] && continue
  # shellcheck disable=SC2086
  $cli plan $flags --lowered --format csv -o "$name.csv" >/dev/null
done < cases.txt
