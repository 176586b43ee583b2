#!/bin/bash
# The store's cost (BENCHMARKS.md, "The store"): one `pdgate serve` on zero-cost fake workers, with the embedded
# store or with Redis (a redis-server on a Unix socket, started here), alternately, ROUNDS times:
#   [CAPACITY=N] [OUT=benchmarks/NAME] scripts/ab_store.sh BASEPORT [ROUNDS]
# CAPACITY sets [admission] capacity (what real SGLang workers get by default: their max_running_requests), so
# every request has a slot to agree on (one ACQUIRE on its path, shared by the requests of one turn of the loop);
# without it the fake workers report no capacity and a request has nothing to agree on. OUT: NAME.json (every
# row) and NAME.png.
# Each measurement: 64 connections closed loop for 12 s (the gateway's CPU per request, from /proc; Redis's own
# CPU per request beside it; Redis calls per request from INFO commandstats), then an open loop at 100 req/s
# for 10 s (p50 latency: what a request waits, far below capacity). Every setting is the default but the store.
set -euo pipefail
base=$1; rounds=${2:-3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
cd "$ROOT"
tmp=$(mktemp -d)
$PY -m loadtest.fakeworker --role prefill --port $((base+1)) > /dev/null 2>&1 & p1=$!
$PY -m loadtest.fakeworker --role decode --port $((base+2)) > /dev/null 2>&1 & p2=$!
redis-server --port 0 --unixsocket "$tmp/r.sock" --unixsocketperm 700 --save '' --appendonly no \
    > "$tmp/redis.log" 2>&1 & r=$!
trap 'kill $p1 $p2 $r ${g:-} 2>/dev/null || true; rm -rf "$tmp"' EXIT
sleep 1
: > "$tmp/rows.jsonl"
conf=()
if [ -n "${CAPACITY:-}" ]; then printf '[admission]\ncapacity = %d\n' "$CAPACITY" > "$tmp/g.toml"; conf=(--config "$tmp/g.toml"); fi
measure() {  # $1: embedded | redis
    local store=()
    [ "$1" = redis ] && store=(--store "unix:$tmp/r.sock")
    $PY -m pdgate serve --port $((base+3)) --admin-port $((base+4)) --prefill http://127.0.0.1:$((base+1)) 8998 \
        --decode http://127.0.0.1:$((base+2)) --log-level WARNING "${store[@]}" "${conf[@]}" > "$tmp/g.log" 2>&1 & g=$!
    sleep 2
    redis-cli -s "$tmp/r.sock" config resetstat > /dev/null
    local t0 r0 t1 r1
    t0=$(awk '{print $14+$15}' /proc/$g/stat); r0=$(awk '{print $14+$15}' /proc/$r/stat)
    timeout 60 $PY -m loadtest bench --target http://127.0.0.1:$((base+3)) --concurrency 64 --duration 12 \
        --out "$tmp/closed.json" > /dev/null 2>&1
    t1=$(awk '{print $14+$15}' /proc/$g/stat); r1=$(awk '{print $14+$15}' /proc/$r/stat)
    local scripts
    scripts=$(redis-cli -s "$tmp/r.sock" info commandstats | awk -F'[=,:]' '/^cmdstat_evalsha:/ {n+=$3} END {print n+0}')
    timeout 60 $PY -m loadtest bench --target http://127.0.0.1:$((base+3)) --rate 100 --duration 10 \
        --out "$tmp/open.json" > /dev/null 2>&1
    # CPU per request where nothing is saturated (the closed loop's figure moves with whatever else takes the
    # machine's two cores, Redis included): an open loop at 1000 req/s, a fifth of the capacity
    local o0 o1
    o0=$(awk '{print $14+$15}' /proc/$g/stat)
    timeout 60 $PY -m loadtest bench --target http://127.0.0.1:$((base+3)) --rate 1000 --duration 8 \
        --out "$tmp/open1k.json" > /dev/null 2>&1
    o1=$(awk '{print $14+$15}' /proc/$g/stat)
    # round trips, from MONITOR (its own phase: MONITOR costs Redis CPU): a command from a client is one, a
    # MULTI..EXEC is one, a command a script runs (MONITOR's "lua" lines) none
    : > "$tmp/mon.txt"
    if [ "$1" = redis ]; then
        timeout 9 redis-cli -s "$tmp/r.sock" monitor > "$tmp/mon.txt" 2>/dev/null & local m=$!
        sleep 0.5
        timeout 30 $PY -m loadtest bench --target http://127.0.0.1:$((base+3)) --rate 50 --duration 6 \
            --out "$tmp/mon.json" > /dev/null 2>&1
        wait $m 2>/dev/null || true
    fi
    kill $g; wait $g 2>/dev/null || true; g=
    $PY - "$1" "$t0" "$t1" "$r0" "$r1" "$scripts" "$tmp" "$o0" "$o1" <<'EOF'
import collections, json, os, re, sys
store, t0, t1, r0, r1, scripts, tmp = sys.argv[1], *map(float, sys.argv[2:7]), sys.argv[7]
o0, o1 = float(sys.argv[8]), float(sys.argv[9])
def result(name):
    o = json.load(open(f"{tmp}/{name}.json"))
    return list(list(o["results"].values())[0].values())[0]
c, o = result("closed"), result("open")
tick = os.sysconf("SC_CLK_TCK")
row = {"store": store, "capacity": int(os.environ.get("CAPACITY") or 0) or None, "rps": round(c["rps"]), "gateway_cpu_us_per_req": round((t1 - t0) / tick * 1e6 / c["ok"], 1),
       "redis_cpu_us_per_req": round((r1 - r0) / tick * 1e6 / c["ok"], 1) if store == "redis" else 0.0,
       "redis_scripts_per_req": round(scripts / c["ok"], 3) if store == "redis" else 0.0,
       "open_1000rps_cpu_us_per_req": round((o1 - o0) / tick * 1e6 / result("open1k")["ok"], 1),
       "open_100rps_p50_ms": round(o["p50_ms"], 2), "open_100rps_p99_ms": round(o["p99_ms"], 2)}
if store == "redis":
    trips, in_multi, kinds = 0, set(), collections.Counter()
    for line in open(f"{tmp}/mon.txt"):
        m = re.match(r'[0-9.]+ \[\d+ ([^\]]+)\] "([^"]+)"', line)
        if not m or m[1] == "lua":
            continue
        client, cmd = m[1], m[2].upper()
        if cmd == "EXEC":
            in_multi.discard(client)
        elif client in in_multi:
            continue
        elif cmd == "MULTI":
            in_multi.add(client)
            trips += 1; kinds["MULTI..EXEC"] += 1
        else:
            trips += 1; kinds[cmd] += 1
    ok = result("mon")["ok"]
    row["round_trips_per_req_at_50rps"] = round(trips / ok, 3)
    row["round_trips_by_command"] = dict(kinds)
print(json.dumps(row), flush=True)
with open(f"{tmp}/rows.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")
EOF
}
for i in $(seq "$rounds"); do
    if [ $((i % 2)) = 1 ]; then measure embedded; measure redis; else measure redis; measure embedded; fi
done
if [ -n "${OUT:-}" ]; then
    $PY - "$tmp/rows.jsonl" "$OUT" "$rounds" <<'EOF'
import json, statistics, sys
rows = [json.loads(x) for x in open(sys.argv[1])]
out, rounds = sys.argv[2], int(sys.argv[3])
med = {s: {k: statistics.median(r[k] for r in rows if r["store"] == s)
           for k in ("rps", "gateway_cpu_us_per_req", "open_1000rps_cpu_us_per_req", "redis_cpu_us_per_req",
                     "open_100rps_p50_ms", "open_100rps_p99_ms")}
       for s in ("embedded", "redis")}
ratio = {"gateway_cpu": round(med["redis"]["gateway_cpu_us_per_req"] / med["embedded"]["gateway_cpu_us_per_req"], 3),
         "gateway_cpu_at_1000rps": round(med["redis"]["open_1000rps_cpu_us_per_req"]
                                         / med["embedded"]["open_1000rps_cpu_us_per_req"], 3),
         "added_p50_ms": round(med["redis"]["open_100rps_p50_ms"] - med["embedded"]["open_100rps_p50_ms"], 3)}
json.dump({"command": f"scripts/ab_store.sh BASEPORT {rounds}", "capacity": rows[0]["capacity"], "medians": med,
           "redis_vs_embedded": ratio, "rows": rows}, open(out + ".json", "w"), indent=1)
print(json.dumps({"medians": med, "redis_vs_embedded": ratio}))
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(0)
fig, ax = plt.subplots(1, 3, figsize=(14, 4))
for i, s in enumerate(("embedded", "redis")):
    mine = [r for r in rows if r["store"] == s]
    ax[0].scatter([i] * len(mine), [r["gateway_cpu_us_per_req"] for r in mine], label=f"{s} (each round)")
    ax[0].bar(i, med[s]["gateway_cpu_us_per_req"], alpha=0.3, label=f"{s} median")
    ax[1].scatter([i] * len(mine), [r["open_1000rps_cpu_us_per_req"] for r in mine], label=f"{s} (each round)")
    ax[1].bar(i, med[s]["open_1000rps_cpu_us_per_req"], alpha=0.3, label=f"{s} median")
    ax[2].scatter([i] * len(mine), [r["open_100rps_p50_ms"] for r in mine], label=f"{s} p50")
    ax[2].scatter([i + 0.1] * len(mine), [r["open_100rps_p99_ms"] for r in mine], marker="x", label=f"{s} p99")
for a, t, y in ((ax[0], "gateway CPU per request, 64 connections", "CPU µs per request"),
                (ax[1], "gateway CPU per request, 1000 req/s open loop", "CPU µs per request"),
                (ax[2], "latency at 100 requests/s (open loop)", "latency (ms)")):
    a.set_xticks([0, 1], ["embedded store", "Redis store"])
    a.set_title(t)
    a.set_ylabel(y)
    a.set_xlabel("store")
    a.legend(fontsize=7)
cap = rows[0]["capacity"]
fig.suptitle(f"pdgate serve on fake workers, {rounds} alternating rounds; [admission] capacity = {cap or 'none (default)'}")
fig.tight_layout()
fig.savefig(out + ".png", dpi=110)
EOF
fi
