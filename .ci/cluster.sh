#!/usr/bin/env bash
# A throwaway Redis Cluster on 127.0.0.1 for the cluster tests: 3 masters and
# 3 replicas (one per master), cluster-require-full-coverage off, as a
# production cluster that must keep serving the healthy masters' slots.
#
#   eval "$(.ci/cluster.sh start)"   # starts it; prints: export DEDUP_TEST_CLUSTER=...
#   .ci/cluster.sh stop               # stops it and removes its files
#   .ci/cluster.sh env                # prints the export line again
#
# Ports: DEDUP_CLUSTER_PORTS (default "7100 7101 7102 7103 7104 7105": the first
# half masters, the second their replicas). Files (nodes-P.conf,
# logs, pid files) live in DEDUP_CLUSTER_DIR (default ${TMPDIR:-/tmp}/dedup-cluster).
# Persistence is off. Only the export line goes to stdout; progress goes to stderr.
# (No grep -q in pipelines: with pipefail its early exit would fail the check.)
set -euo pipefail

ports=(${DEDUP_CLUSTER_PORTS:-7100 7101 7102 7103 7104 7105})
dir=${DEDUP_CLUSTER_DIR:-${TMPDIR:-/tmp}/dedup-cluster}
host=127.0.0.1

say() { echo "cluster.sh: $*" >&2; }

addrs() {
	local out="" p
	for p in "${ports[@]}"; do out+="${out:+,}$host:$p"; done
	echo "$out"
}

cli() { redis-cli -h "$host" -p "$1" "${@:2}"; }

cluster_ok() {
	local p
	for p in "${ports[@]}"; do
		cli "$p" cluster info 2>/dev/null | tr -d '\r' | grep -x 'cluster_state:ok' >/dev/null || return 1
		[ "$(cli "$p" cluster info 2>/dev/null | tr -d '\r' | sed -n 's/^cluster_known_nodes://p')" = "${#ports[@]}" ] || return 1
		# every node sees half the nodes as replicas
		[ "$(cli "$p" cluster nodes 2>/dev/null | awk '$3 ~ /slave/' | wc -l)" = "$((${#ports[@]} / 2))" ] || return 1
		if cli "$p" info replication 2>/dev/null | tr -d '\r' | grep -x 'role:slave' >/dev/null; then
			cli "$p" info replication | tr -d '\r' | grep -x 'master_link_status:up' >/dev/null || return 1
		fi
	done
}

start() {
	command -v redis-server >/dev/null && command -v redis-cli >/dev/null ||
		{ say "needs redis-server and redis-cli (apt-get install redis-server redis-tools)"; exit 1; }
	if cluster_ok 2>/dev/null; then
		say "already running on $(addrs)"
		echo "export DEDUP_TEST_CLUSTER=$(addrs)"
		return
	fi
	mkdir -p "$dir"
	local p
	for p in "${ports[@]}"; do
		if cli "$p" ping >/dev/null 2>&1; then
			say "port $p already answers but is not a healthy cluster node of ours; run '$0 stop' or pick DEDUP_CLUSTER_PORTS"
			exit 1
		fi
		rm -f "$dir/nodes-$p.conf"
		redis-server --port "$p" --bind "$host" --cluster-enabled yes \
			--cluster-config-file "nodes-$p.conf" --cluster-node-timeout 5000 \
			--cluster-require-full-coverage no --repl-diskless-sync-delay 0 \
			--dir "$dir" --save "" --appendonly no --daemonize yes \
			--pidfile "$dir/redis-$p.pid" --logfile "$dir/redis-$p.log" --loglevel warning
	done
	for p in "${ports[@]}"; do
		for _ in $(seq 100); do
			cli "$p" ping >/dev/null 2>&1 && break
			sleep 0.1
		done
		cli "$p" ping >/dev/null || { say "redis-server on $p did not start; see $dir/redis-$p.log"; exit 1; }
	done
	local nodes=()
	for p in "${ports[@]}"; do nodes+=("$host:$p"); done
	say "creating the cluster on ${nodes[*]}"
	redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$dir/create.log" 2>&1 ||
		{ cat "$dir/create.log" >&2; exit 1; }
	for _ in $(seq 300); do
		if cluster_ok; then
			say "cluster_state:ok on every node"
			echo "export DEDUP_TEST_CLUSTER=$(addrs)"
			return
		fi
		sleep 0.1
	done
	say "the cluster did not reach cluster_state:ok in 30 s"
	for p in "${ports[@]}"; do cli "$p" cluster info >&2 || true; done
	exit 1
}

stop() {
	local p pid
	for p in "${ports[@]}"; do
		if [ -f "$dir/redis-$p.pid" ]; then
			pid=$(cat "$dir/redis-$p.pid")
			# Our own server only: the pid file's process, if it is still redis-server on port p.
			if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "redis-server.*:$p"; then
				kill "$pid" 2>/dev/null || true
			fi
			for _ in $(seq 50); do
				kill -0 "$pid" 2>/dev/null || break
				sleep 0.1
			done
		fi
	done
	rm -rf "$dir"
	say "stopped"
}

case "${1:-}" in
start) start ;;
stop) stop ;;
env) echo "export DEDUP_TEST_CLUSTER=$(addrs)" ;;
*)
	echo "usage: $0 start|stop|env" >&2
	exit 2
	;;
esac
