#!/usr/bin/env bash
# .ci/asynq-version.sh VERSION: builds the library, dedupctl and dedupprom
# against asynq VERSION and runs internal/versions (the promises kept on
# every asynq version; docs/versions.md) on it. go.mod stays as it is: an
# alternate go.mod in a temporary directory pins VERSION (go's -modfile).
set -euo pipefail
cd "$(dirname "$0")/.."
v=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mod=$dir/go.mod
cp go.mod "$mod"
cp go.sum "$dir/go.sum"
go mod edit -modfile="$mod" -require=github.com/hibiken/asynq@"$v"
go mod tidy -modfile="$mod" -e >/dev/null
got=$(go list -modfile="$mod" -m -f '{{.Version}}' github.com/hibiken/asynq)
if [ "$got" != "$v" ]; then
	echo "asynq $v asked, $got linked"; exit 1
fi
go build -modfile="$mod" . ./cmd/dedupctl ./dedupprom ./internal/...
go vet -modfile="$mod" ./internal/versions
log=$dir/test.log
if ! go test -modfile="$mod" -race -count=1 -timeout 5m -v ./internal/versions >"$log" 2>&1; then
	cat "$log"; .ci/failures.sh "$log"; exit 1
fi
if grep -q -- '--- SKIP' "$log"; then
	echo "tests skipped on asynq $v:"; grep -A1 -- '--- SKIP' "$log"; exit 1
fi
echo "asynq $v: $(grep -c -- '--- PASS' "$log") tests and subtests passed"
