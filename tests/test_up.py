"""Supervisor, `pdgate up`, the restart endpoint and the operator CLI against a live stack."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engine.supervisor import Supervisor, load_cluster
from tests.procs import ROOT, Procs, free_port, wait_http


def cluster_file(tmp: Path, prefills: int = 1, decodes: int = 1, args: tuple[str, ...] = ()) -> Path:
    lines = [f'[cluster]\nlog_dir = "{tmp / "logs"}"\nrestart_backoff_s = [0.2]\n']
    extra = f"args = {json.dumps(list(args))}\n" if args else ""
    for i in range(prefills):
        lines.append(f'[[worker]]\nname = "prefill-{i}"\nrole = "prefill"\nport = {free_port()}\n'
                     f'bootstrap_port = {free_port()}\n{extra}')
    for i in range(decodes):
        lines.append(f'[[worker]]\nname = "decode-{i}"\nrole = "decode"\nport = {free_port()}\n{extra}')
    path = tmp / "cluster.toml"
    path.write_text("\n".join(lines))
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def get(url: str, key: str | None = None) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def post(url: str, body: dict[str, Any] | None = None, key: str | None = None,
         timeout: float = 30) -> tuple[int, Any, dict[str, str]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null"), dict(exc.headers)


async def test_supervisor_restarts_a_killed_worker(tmp_path: Path) -> None:
    sup = Supervisor(load_cluster(cluster_file(tmp_path, 0, 1)))
    try:
        await sup.start()
        child = sup.children["decode-0"]
        assert child.proc is not None
        first = child.proc.pid
        os.kill(first, signal.SIGKILL)
        for _ in range(100):
            if child.proc.pid != first and child.ready.is_set():
                break
            await asyncio.sleep(0.1)
        assert child.proc.pid != first and child.restarts == 1 and child.ready.is_set()
        assert "--- start" in (tmp_path / "logs" / "decode-0.log").read_text()
    finally:
        await sup.stop()
    assert not alive(child.proc.pid)


async def test_the_workers_run_in_process_groups_of_their_own_in_the_supervisors_session(tmp_path: Path) -> None:
    """A worker's process group is its own (a terminal's Ctrl-C reaches the supervisor alone), its session the
    supervisor's: with the kernel's autogroup scheduling every session is a scheduling group of its own, and a real
    vLLM pair in sessions of their own starved the gateway's session for up to 30 s at a time
    (``scripts/sched_sessions.py``; BENCHMARKS.md, run AC)."""
    sup = Supervisor(load_cluster(cluster_file(tmp_path, 1, 1)))
    try:
        await sup.start()
        for child in sup.children.values():
            assert child.proc is not None
            pid = child.proc.pid
            assert (os.getpgid(pid), os.getsid(pid)) == (pid, os.getsid(0)), child.spec.name
    finally:
        await sup.stop()


def test_cluster_file_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[worker]]\nname = "x"\nrole = "router"\nport = 1\n')
    with pytest.raises(ValueError, match=r"role must be prefill or decode"):
        load_cluster(bad)
    bad.write_text('[[worker]]\nname = "x"\nengine = "trtllm"\nrole = "decode"\nport = 1\n')
    with pytest.raises(ValueError, match=r"engine 'trtllm' not supported"):
        load_cluster(bad)
    bad.write_text('[[worker]]\nname = "x"\nengine = "vllm"\nkind = "sglang"\nrole = "decode"\nport = 1\n')
    with pytest.raises(ValueError, match=r"a real engine speaks its own"):
        load_cluster(bad)
    bad.write_text('[[worker]]\nname = "x"\nengine = "vllm"\nrole = "decode"\nport = 1\ngpus = [0]\n')
    with pytest.raises(ValueError, match=r"worker 'x': unknown key 'gpus'"):
        load_cluster(bad)
    # every error at once, each naming its worker; a misspelt key gets "did you mean"; a port must be an integer
    bad.write_text('[[worker]]\nname = "p"\nrol = "prefill"\nport = "47010"\n'
                   '[[worker]]\nname = "d"\nrole = "decode"\nport = 47012\n'
                   '[[worker]]\nname = "d"\nrole = "decode"\nport = 47012\n')
    with pytest.raises(ValueError) as e:
        load_cluster(bad)
    lines = str(e.value).splitlines()
    assert f"{bad}: worker 'p': unknown key 'rol'; did you mean 'role'?" in lines
    assert f"{bad}: worker 'p': port must be an integer port (1-65535), got '47010'" in lines
    assert f"{bad}: worker 'd': name repeated" in lines
    assert f"{bad}: worker 'd': port 47012 is also worker d's port" in lines
    # --base-port moves every worker (and the packaged clusters do not collide)
    moved = load_cluster(ROOT / "config/cluster.sim.toml", base_port=47000)
    assert [(w.port, w.bootstrap_port) for w in moved.workers] == [(47010, 47011), (47012, 47013), (47014, None),
                                                                   (47016, None)]
    ports = [p for f in ("cluster.sim.toml", "cluster.vllm-sim.toml", "cluster.vllm-cpu.toml", "cluster.sm120-8gpu.toml")
             for w in load_cluster(ROOT / "config" / f).workers for p in (w.port, w.bootstrap_port) if p]
    assert len(ports) == len(set(ports)), "the packaged clusters may run side by side"


def cli(admin: str, *args: str, key_file: Path | None = None, check: bool = True) -> str:
    env = {**os.environ, "COLUMNS": "200", "PDGATE_ADMIN_URL": admin}
    env.pop("PDGATE_ADMIN_KEY", None)
    if key_file is not None:
        env["PDGATE_ADMIN_KEY_FILE"] = str(key_file)
    out = subprocess.run([sys.executable, "-m", "pdgate", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=30, env=env)
    if check:
        assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


def up_command(tmp_path: Path, port: int, admin_port: int, *extra: str) -> list[str]:
    cluster = tmp_path / "cluster.toml"
    if not cluster.exists():  # one cluster per test directory: a second `up` in the same test runs the same one
        cluster_file(tmp_path, 1, 1)
    return [sys.executable, "-m", "pdgate", "up", "--cluster", str(cluster), "--port", str(port),
            "--admin-port", str(admin_port), "--admin-key-file", str(tmp_path / "admin.key"), *extra]


def test_pdgate_up_end_to_end(procs: Procs, tmp_path: Path) -> None:
    port, admin_port = free_port(), free_port()
    up = procs.spawn(up_command(tmp_path, port, admin_port), name="pdgate-up")
    gw = f"http://127.0.0.1:{port}"
    admin = f"http://127.0.0.1:{admin_port}"
    key_file = tmp_path / "admin.key"
    t0 = time.monotonic()
    wait_http(gw + "/readiness", timeout=60, proc=up.popen)
    status, body, headers = post(gw + "/v1/chat/completions", {"model": "sim-model", "messages": [
        {"role": "user", "content": "say hi"}], "max_tokens": 8})
    assert status == 200 and body["usage"]["completion_tokens"] == 8 and time.monotonic() - t0 < 60
    assert "pdgate is up" in up.logs() and "curl" in up.logs()
    rid = headers["x-request-id"]

    assert f"admin plane: {admin}" in up.logs() and str(key_file) in up.logs()
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = key_file.read_text().strip()
    assert key not in up.logs()

    out = cli(admin, "trace", rid, key_file=key_file)
    for s in (rid, "completed", "prefill+transfer", "decode_done", "attempt 1"):
        assert s in out, s
    assert f"instance  {rid.split('-')[1]}  request #1" in out, "the id read back: who owns it, its place"
    out = cli(admin, "workers", key_file=key_file)
    assert out.count(" up ") == 2 and "p0" in out and "d0" in out
    assert "live requests: 0" in cli(admin, "ps", key_file=key_file)
    assert json.loads(cli(admin, "ps", "--json", key_file=key_file))["count"] == 0
    assert "workers" in cli(admin, "top", "--iterations", "1", "--interval", "0.1", key_file=key_file)
    frames = cli(admin, "top", "--json", "--iterations", "2", "--interval", "0.1", key_file=key_file).splitlines()
    assert len(frames) == 2 and all(json.loads(f)["workers"]["workers"] for f in frames), "top --json: a line a frame"
    denied = cli(admin, "ps", key_file=tmp_path / "missing", check=False)
    assert "401" in denied and "admin key" in denied, denied
    assert post(gw + "/v1/workers/d0/restart")[0] == 401, "operator endpoints are not on the front door"

    pids = {p["name"]: p["pid"] for p in get(admin + "/v1/cluster", key)["processes"]}
    before = {w["id"]: w["identity"] for w in get(admin + "/v1/workers", key)["workers"]}
    status, body, _ = post(admin + "/v1/workers/d0/restart", key=key)
    assert status == 200 and body["process"]["pid"] != pids["decode-0"] and body["worker"]["healthy"]
    assert body["worker"]["identity"] != before["d0"]
    assert not alive(pids["decode-0"])
    pids["decode-0"] = body["process"]["pid"]
    status, _, _ = post(gw + "/v1/chat/completions", {"model": "sim-model", "messages": [
        {"role": "user", "content": "again"}], "max_tokens": 2})
    assert status == 200

    assert up.popen is not None
    up.popen.send_signal(signal.SIGTERM)
    assert up.popen.wait(15) == 0
    time.sleep(0.2)
    assert [n for n, pid in pids.items() if alive(pid)] == [], "no worker may outlive pdgate up"


def test_a_second_up_of_the_same_cluster_is_refused_before_it_starts_anything(procs: Procs, tmp_path: Path) -> None:
    port, admin_port = free_port(), free_port()
    first = procs.spawn(up_command(tmp_path, port, admin_port), name="pdgate-up")
    wait_http(f"http://127.0.0.1:{port}/readiness", timeout=60, proc=first.popen)
    logs = tmp_path / "logs" / f"pdgate-{port}"
    assert sorted(p.name for p in logs.iterdir()) == ["decode-0.log", "prefill-0.log"], "logs per instance"
    sizes = {p.name: p.stat().st_size for p in logs.iterdir()}
    other = free_port()
    out = subprocess.run(up_command(tmp_path, other, free_port()), cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "worker prefill-0 port" in out.stderr and "in use: is this cluster already up?" in out.stderr, out.stderr
    assert not (tmp_path / "logs" / f"pdgate-{other}").exists(), "nothing of the second one started"
    assert {p.name: p.stat().st_size for p in logs.iterdir()} == sizes, "nor did it write into the first one's logs"
    elsewhere = tmp_path / "b"
    elsewhere.mkdir()
    gw_taken = subprocess.run([sys.executable, "-m", "pdgate", "up", "--cluster", str(cluster_file(elsewhere)),
                               "--port", str(port), "--admin-port", str(free_port()),
                               "--admin-key-file", str(tmp_path / "admin.key")],
                              cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert gw_taken.returncode == 2 and f"--port = {port}: cannot listen there" in gw_taken.stderr, gw_taken.stderr
    assert "choose another with --port" in gw_taken.stderr


EXAMPLE_PORTS = (30010, 30011, 30020, 30021, 30910, 30911)


def test_up_from_any_directory_runs_the_packaged_example(procs: Procs, tmp_path: Path) -> None:
    from pdgate.planes.multi import port_free

    if not all(port_free("127.0.0.1", p) for p in EXAMPLE_PORTS):
        pytest.skip(f"the example cluster's ports {EXAMPLE_PORTS} are in use here")
    port, admin_port = free_port(), free_port()
    up = procs.spawn([sys.executable, "-m", "pdgate", "up", "--port", str(port), "--admin-port", str(admin_port)],
                     name="pdgate-up-example", cwd=tmp_path)
    wait_http(f"http://127.0.0.1:{port}/readiness", timeout=90, proc=up.popen)
    status, body, _ = post(f"http://127.0.0.1:{port}/v1/chat/completions", {"model": "sim-model", "messages": [
        {"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert (tmp_path / "logs" / f"pdgate-{port}" / "prefill-0.log").exists()
    assert (tmp_path / ".pdgate" / "admin.key").exists()


def test_base_port_moves_everything_and_the_cli_and_storm_find_it_with_no_flag(procs: Procs, tmp_path: Path) -> None:
    """A newcomer's path: ``pdgate up --base-port N --policy session`` from a directory, then the operator commands
    and the storm from the same directory with no flag; the banner names the dashboard; a stopped up's file goes."""
    from pdgate.planes.multi import port_free

    base = next(b for b in (free_port() // 100 * 100 for _ in range(50))
                if b > 1024 and all(port_free("127.0.0.1", b + i) for i in range(20)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDGATE_")}
    up = procs.spawn([sys.executable, "-m", "pdgate", "up", "--cluster", str(ROOT / "config/cluster.sim.toml"),
                      "--base-port", str(base), "--policy", "session"], name="pdgate-up-base", cwd=tmp_path, env=env)
    gw, admin = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
    wait_http(gw + "/readiness", timeout=90, proc=up.popen)
    workers = get(admin + "/v1/workers", (tmp_path / ".pdgate/admin.key").read_text().strip())["workers"]
    assert sorted(w["url"] for w in workers) == [f"http://127.0.0.1:{base + p}" for p in (10, 12, 14, 16)]
    assert json.loads((tmp_path / ".pdgate/up.json").read_text()) == {"front": gw, "admin": admin,
                                                                      "pid": up.popen.pid, "model": "sim-model"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              env={**env, "PYTHONPATH": str(ROOT), "COLUMNS": "120"})

    import openai

    with openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(model="sim-model", max_tokens=4, messages=[
            {"role": "user", "content": "hi"}])
    rid = raw.headers["x-request-id"]
    for args in (("pdgate", "workers"), ("pdgate", "ps"), ("pdgate", "top", "--iterations", "1"),
                 ("pdgate", "trace", rid)):
        out = run(*args)
        assert out.returncode == 0, out
        assert args[1] in ("ps", "trace") or f"127.0.0.1:{base + 10}" in out.stdout, out.stdout
        assert args[1] != "trace" or rid in out.stdout, out.stdout
    storm = run("loadtest", "storm", "--iterations", "2", "--instances", "1", "--window", "6", "--watchdog", "2",
                "--grace", "1")
    assert storm.returncode == 0, storm.stdout[-3000:]
    assert f"dashboard: {admin}/dashboard" in up.log.read_text()
    up.popen.send_signal(signal.SIGINT)
    up.popen.wait(30)
    assert not (tmp_path / ".pdgate/up.json").exists()
    out = run("pdgate", "ps")
    assert out.returncode != 0 and "--admin URL or PDGATE_ADMIN_URL" in out.stderr, out.stderr


def test_cli_reads_at_80_columns_and_in_a_pipe(procs: Procs, tmp_path: Path) -> None:
    port, admin_port = free_port(), free_port()
    up = procs.spawn(up_command(tmp_path, port, admin_port), name="pdgate-up")
    gw, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    wait_http(gw + "/readiness", timeout=60, proc=up.popen)
    _, _, headers = post(gw + "/v1/chat/completions", {"model": "sim-model", "messages": [
        {"role": "user", "content": "say hi"}], "max_tokens": 4})
    rid = headers["x-request-id"]
    # no admin URL given: the CLI finds it where up wrote it, beside the admin key (tmp_path/up.json)
    env = {**os.environ, "COLUMNS": "80", "PDGATE_ADMIN_KEY_FILE": str(tmp_path / "admin.key")}
    env.pop("PDGATE_ADMIN_URL", None)
    assert json.loads((tmp_path / "up.json").read_text())["admin"] == admin

    def run(*args: str, columns: str = "80") -> str:
        out = subprocess.run([sys.executable, "-m", "pdgate", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, env={**env, "COLUMNS": columns})  # a pipe: laid out for COLUMNS, no colour
        assert out.returncode == 0, out.stderr
        return out.stdout

    for args in (("workers",), ("workers", "--wide"), ("trace", rid), ("ps",), ("ps", "--wide"),
                 ("top", "--iterations", "1", "--interval", "0.1"), ("top", "--wide", "--iterations", "1")):
        text = run(*args)
        assert text.strip() and all(len(line) <= 80 for line in text.splitlines()), (args, text)
        assert "…" not in text, (args, text)  # nothing cut: values wrap
    trace = run("trace", rid)
    assert rid in trace and f"rid {rid}.1" in trace, "the id and the attempt's rid whole"
    workers = run("workers")
    assert "p0" in workers and "http://127.0.0.1:" in workers.replace("\n", "")
    top = run("top", "--iterations", "1", "--interval", "0.1")
    assert all(w["url"] in top.replace("\n", "") for w in get(admin + "/v1/workers", (tmp_path / "admin.key")
                                                              .read_text().strip())["workers"]), top
    assert "identity" not in workers and "identity" in run("workers", "--wide", columns="200")
    for args in (("workers", "--json"), ("ps", "--json"), ("trace", rid, "--json")):
        json.loads(run(*args))
    assert "(default: http://127.0.0.1:30002)" in run("ps", "--help").replace("\n", " ").replace("  ", " ") or \
        "default:" in run("ps", "--help")


def test_pdgate_up_with_two_gateway_processes(procs: Procs, tmp_path: Path) -> None:
    """`pdgate up --workers 2`: two gateway processes on one port; the admin plane answers for both, and a worker
    restart asked of either is done by the supervisor of the workers (this process) once."""
    port, admin_port = free_port(), free_port()
    up = procs.spawn(up_command(tmp_path, port, admin_port, "--workers", "2"), name="pdgate-up")
    gw, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    wait_http(gw + "/readiness", timeout=60, proc=up.popen)
    end = time.monotonic() + 10
    while "pdgate is up" not in up.logs() and time.monotonic() < end:  # once every process listens
        time.sleep(0.1)
    assert "2 gateway processes" in up.logs()
    key = (tmp_path / "admin.key").read_text().strip()
    owners = set()
    for _ in range(30):  # a new connection each: the kernel spreads them over both processes
        status, _, headers = post(gw + "/v1/chat/completions", {"model": "sim-model", "messages": [
            {"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200
        owners.add(headers["x-request-id"].split("-")[1])
        rid = headers["x-request-id"]
        assert get(f"{admin}/v1/requests/{rid}", key)["outcome"] == "completed"
    assert len(owners) == 2, owners
    assert len(get(admin + "/v1/dashboard", key)["instances"]) == 2, "one dashboard for both processes"
    pids = {p["name"]: p["pid"] for p in get(admin + "/v1/cluster", key)["processes"]}
    status, body, _ = post(admin + "/v1/workers/d0/restart", key=key)
    assert status == 200 and body["process"]["pid"] != pids["decode-0"]
    after = {p["name"]: p["pid"] for p in get(admin + "/v1/cluster", key)["processes"]}
    assert after["decode-0"] == body["process"]["pid"] and after["prefill-0"] == pids["prefill-0"], \
        "restarted once, by the supervisor of the workers"
    assert post(gw + "/v1/chat/completions", {"model": "sim-model", "messages": [
        {"role": "user", "content": "again"}], "max_tokens": 2})[0] == 200
    assert up.popen is not None
    up.popen.send_signal(signal.SIGTERM)
    assert up.popen.wait(20) == 0
    time.sleep(0.2)
    assert [n for n, pid in after.items() if alive(pid)] == [], "no worker may outlive pdgate up"


def test_pdgate_up_with_sglang_and_vllm_pools_and_the_storm_verdict(procs: Procs, tmp_path: Path) -> None:
    """A cluster file naming each worker's kind (as config/cluster.vllm-sim.toml does): `pdgate up` starts vLLM-
    protocol sims beside SGLang ones, the gateway talks to each through its adapter, `pdgate workers` shows the
    kind, and `loadtest storm` gives its verdict on the mixed cluster."""
    lines = [f'[cluster]\nlog_dir = "{tmp_path / "logs"}"\nrestart_backoff_s = [0.2]\n']
    for name, kind, role in (("vp", "vllm", "prefill"), ("vd", "vllm", "decode"), ("sp", "sglang", "prefill"),
                             ("sd", "sglang", "decode")):
        extra = f"bootstrap_port = {free_port()}\n" if role == "prefill" else ""
        lines.append(f'[[worker]]\nname = "{name}"\nkind = "{kind}"\nrole = "{role}"\nport = {free_port()}\n{extra}'
                     'args = ["--eos-after", "24"]\n')
    (tmp_path / "cluster.toml").write_text("\n".join(lines))
    port, admin_port = free_port(), free_port()
    up = procs.spawn(up_command(tmp_path, port, admin_port), name="pdgate-up")
    gw, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    key_file = tmp_path / "admin.key"
    wait_http(gw + "/readiness", timeout=60, proc=up.popen)
    for _ in range(50):  # both pairs up
        ws = get(admin + "/v1/workers", key_file.read_text().strip())["workers"]
        if len(ws) == 4 and all(w["healthy"] for w in ws):
            break
        time.sleep(0.2)
    assert sorted((w["kind"], w["role"]) for w in ws) == [("sglang", "decode"), ("sglang", "prefill"),
                                                          ("vllm", "decode"), ("vllm", "prefill")], ws
    for i in range(6):
        status, body, _ = post(gw + "/v1/chat/completions", {"model": "sim-model", "max_tokens": 8, "messages": [
            {"role": "user", "content": f"hi {i}"}]})
        assert status == 200 and body["choices"][0]["message"]["content"], body
    wide = cli(admin, "workers", "--wide", key_file=key_file)
    assert "vllm" in wide and "sglang" in wide, wide
    assert "prefill/vllm" in cli(admin, "workers", key_file=key_file), "the default view names another engine too"
    out = tmp_path / "storm.json"
    run = subprocess.run([sys.executable, "-m", "loadtest", "storm", "--gateway", gw, "--admin", admin,
                          "--admin-key", key_file.read_text().strip(), "--iterations", "6", "--instances", "4",
                          "--watchdog", "1", "--grace", "1", "--window", "4", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    verdict = json.loads(out.read_text())
    assert run.returncode == 0 and verdict["verdict"] == "PASS", run.stdout[-2000:] + run.stderr[-2000:]
    assert len(verdict["prefill_metrics"]) == 2 and all(v is not None for v in verdict["baseline"].values()), \
        "the storm read both kinds' prefills"
