#!/usr/bin/env bash
# .ci/failures.sh LOG: prints, for each test that failed in LOG (the output
# of go test -v), the lines that test wrote, so that they come last in CI's
# output and a cut log still shows why. go test -v streams each test's lines
# after a "=== RUN|CONT|NAME|PAUSE <test>" header.
set -euo pipefail
awk '
	/^=== (RUN|CONT|NAME|PAUSE) / { cur = $3; next }
	/^[[:space:]]*--- (PASS|SKIP): / { cur = ""; next }
	/^[[:space:]]*--- FAIL: / { if (!($3 in failed)) order[++n] = $3; failed[$3] = 1; cur = ""; next }
	cur != "" { out[cur] = out[cur] $0 "\n" }
	END {
		for (i = 1; i <= n; i++) {
			t = order[i]
			if (t in out) printf "\n=== what %s wrote (it failed)\n%s", t, out[t]
		}
	}
' "$1"
