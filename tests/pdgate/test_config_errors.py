"""What an operator gets for a bad config or a taken port (issue 17, first part): one line naming the key or the
flag, the value and the reason, exit 2, no traceback. Real `pdgate serve` processes."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ROOT, free_port


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdgate", "serve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(("toml", "words"), [
    ('[gateway]\nport = "30005"\n', "gateway.port = '30005': must be a whole number"),
    ('[gateway\nport = 1\n', "is not valid TOML: Expected ']' at the end of a table declaration (at line 1"),
    ("[gateway]\nmax_attempts = 0\n", "gateway.max_attempts = 0"),
    ("[gateway]\nlog_format = 'xml'\n", "gateway.log_format = 'xml': one of text, json"),
])
def test_config_errors_name_key_value_and_reason(tmp_path: Path, toml: str, words: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    out = serve("--config", str(cfg))
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_missing_file_and_bad_flags(tmp_path: Path) -> None:
    out = serve("--config", str(tmp_path / "nope.toml"))
    assert out.returncode == 2 and "cannot be read: No such file or directory" in out.stderr, out.stderr
    out = serve("--prefill", "http://127.0.0.1:1", "abc")
    assert out.returncode == 2 and "--prefill BOOTSTRAP_PORT = 'abc': must be a TCP port" in out.stderr, out.stderr


def test_a_taken_port_is_one_line_naming_the_flag() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = serve("--port", str(port), "--admin-port", "0")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"--port = {port}: cannot listen there" in out.stderr and "(choose another with --port)" in out.stderr
        out = serve("--port", str(free_port()), "--admin-port", str(port))
        assert out.returncode == 2 and f"--admin-port = {port}: cannot listen there" in out.stderr, out.stderr


def test_every_error_at_once_with_the_file_and_the_nearest_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[gateway]\nport = "30005"\npolcy = "session"\nmax_attempts = 0\n[admision]\ncapacity = 1\n'
                   '[deadlines]\nttft_s = -1\n[routing]\ncache_treshold = 0.5\n[[prefill]]\nurl = "abc"\n[[decode]]\n'
                   'bootstrap_port = 1\n')
    out = serve("--config", str(cfg))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = [ln.strip() for ln in out.stderr.splitlines() if ln.strip().startswith(str(cfg))]
    assert "8 errors:" in out.stderr and len(lines) == 8, out.stderr
    for words in ("gateway.port = '30005': must be a whole number",
                  "gateway.polcy = 'session': unknown key; did you mean 'policy'?",
                  "gateway.max_attempts = 0: must be > 0",
                  "admision = '...': unknown section; did you mean 'admission'?",
                  "deadlines.ttft_s = -1: must be > 0",
                  "routing.cache_treshold = 0.5: unknown key; did you mean 'cache_threshold'?",
                  "prefill[0].url = 'abc': must start with http://",
                  "decode[0] = '...': missing url"):
        assert any(words in ln for ln in lines), (words, out.stderr)


@pytest.mark.parametrize(("data", "words"), [
    ({"deadlines": {"total_s": "30"}}, ["deadlines.total_s = '30': must be a number"]),
    ({"gateway": {"otel": 1}, "otel": {"enabeld": True}},
     ["gateway.otel = 1: belongs in its own section [otel]", "otel.enabeld = True: unknown key; did you mean 'enabled'?"]),
    ({"gateway": {"keys": "x"}, "keys": [{"nme": "a"}]},
     ["gateway.keys = 'x': belongs in its own section [keys]", "keys[0].nme = '<hidden>': unknown key; did you mean"]),
    ({"prefill": [{"ulr": "http://127.0.0.1:30000"}]}, ["prefill[0].ulr", "did you mean 'url'?", "missing url"]),
    ({"keys": 5}, ["keys = '<hidden>': must be a list of tables"]),
    ({"keys": ["a-secret"]}, ["keys[0] = '<hidden>': must be a table"]),
    ({"keys": [{"name": "a", "hsah": "x"}, {"name": "b", "hash": "y"}]},
     ["keys[0].hsah", "did you mean 'hash'?", "keys[0] = '...': missing hash"]),
    ({"keys": [{"name": "a", "hash": "x"}, {"name": "b", "hash": "y"}]},
     ["keys[0].hash = '<hidden>': must be sha256:", "keys[1].hash = '<hidden>': must be sha256:"]),
    ({"gateway": {"instance_id": "pod-7"}}, ["gateway.instance_id = 'pod-7': must be 1-16 lower-case hex digits"]),
    ({"prefill": {"url": "http://127.0.0.1:1"}}, ["prefill = '...': must be [[prefill]] entries"]),
])
def test_shapes_that_used_to_crash_or_hide_errors(data: dict[str, object], words: list[str]) -> None:
    """Found by a hostile review: a wrong type stopped the collection with a TypeError, a section name under
    [gateway] crashed validation, a missing key hid the "did you mean" of its typo, a keys list of the wrong
    shape was a traceback (and could print a key)."""
    from pdgate.core import config

    with pytest.raises(config.ConfigError) as err:
        config.from_mapping(data)
    text = str(err.value)
    assert "a-secret" not in text
    for w in words:
        assert w in text, (w, text)


def test_a_workers_role_is_a_role_once_validated(tmp_path: Path) -> None:
    """What the config, the flags and the admin plane write as text is a ``Role`` once validated: one type the
    pool, the routing and the adapters compare against, whatever spelled it."""
    from pdgate.core import config

    spec = config.validate_worker(config.WorkerSpec(url="http://127.0.0.1:1", role="decode"))  # type: ignore[arg-type]
    assert spec.role is config.Role.DECODE and spec.role == "decode" and f"{spec.role}" == "decode"
    assert config.WorkerSpec(url="http://127.0.0.1:1", role="prefill").role is config.Role.PREFILL  # type: ignore[arg-type]
    f = tmp_path / "g.toml"
    f.write_text('[[prefill]]\nurl = "http://127.0.0.1:1"\n[[decode]]\nurl = "http://127.0.0.1:2"\n')
    cfg = config.load(f)
    assert [w.role for w in (*cfg.prefill, *cfg.decode)] == [config.Role.PREFILL, config.Role.DECODE]
    assert all(type(w.role) is config.Role for w in (*cfg.prefill, *cfg.decode))
    with pytest.raises(config.ConfigError, match="must be prefill or decode"):
        config.validate_worker(config.WorkerSpec(url="http://127.0.0.1:1", role="router"))  # type: ignore[arg-type]
