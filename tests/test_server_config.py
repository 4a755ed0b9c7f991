"""Server configuration: API keys (hashed), loopback rule, config-file validation. No server needed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from corral.errors import InvalidSpec
from corral.server.config import ServerConfig, hash_key, is_loopback, parse_keys


def test_keys_are_kept_only_as_digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = hashlib.sha256(b"carol-secret-key-0000").hexdigest()
    keys = tmp_path / "keys"
    keys.write_text(f"# tenants\nalice=alice-secret-key-000\ncarol=sha256:{digest}\n")
    monkeypatch.setenv("CORRAL_API_KEYS", "bob=bob-secret-key-00000")
    config = ServerConfig.load(keys_file=str(keys))
    assert "alice-secret-key-000" not in json.dumps(config.key_digests)
    assert config.tenant_for("alice-secret-key-000") == "alice"
    assert config.tenant_for("bob-secret-key-00000") == "bob"
    assert config.tenant_for("carol-secret-key-0000") == "carol"
    assert config.tenant_for("alice-secret-key-001") is None
    config.host = "0.0.0.0"
    config.validate()  # keys configured: any address is allowed


def test_bad_keys_and_configs_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORRAL_API_KEYS", raising=False)
    with pytest.raises(InvalidSpec, match="at least 16"):
        parse_keys("alice=short", "test")
    with pytest.raises(InvalidSpec, match="tenant=KEY"):
        parse_keys("no-equals-sign", "test")
    # one key for two tenants merged them into the last one named (the other did not exist)
    with pytest.raises(InvalidSpec, match="alice and bob have the same key"):
        parse_keys("alice=samekey-0123456789ab,bob=samekey-0123456789ab", "test")
    with pytest.raises(InvalidSpec, match="same key"):
        parse_keys(f"alice=sha256:{hash_key('samekey-0123456789ab')},bob=samekey-0123456789ab", "test")
    assert len(parse_keys("alice=samekey-0123456789ab,alice=samekey-0123456789ab", "test")) == 1
    keys = tmp_path / "keys"
    keys.write_text("alice=samekey-0123456789ab\n")
    monkeypatch.setenv("CORRAL_API_KEYS", "bob=samekey-0123456789ab")
    with pytest.raises(InvalidSpec, match="same key"):
        ServerConfig.load(keys_file=str(keys))
    monkeypatch.delenv("CORRAL_API_KEYS")
    with pytest.raises(InvalidSpec, match="without API keys"):
        ServerConfig.load(host="0.0.0.0")
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"max_sandboxes": 3}))
    with pytest.raises(InvalidSpec, match="unknown field"):
        ServerConfig.load(str(bad))
    bad.write_text(json.dumps({"idle_timeout": -1}))
    with pytest.raises(InvalidSpec, match="idle_timeout"):
        ServerConfig.load(str(bad))
    for field in ("max_output_bytes_per_tenant", "max_kept_output_per_tenant", "max_proxied_message_bytes"):
        for value in ("0", "lots", -5):
            bad.write_text(json.dumps({field: value}))
            with pytest.raises(InvalidSpec):
                ServerConfig.load(str(bad))
        bad.write_text(json.dumps({field: "3M"}))
        assert getattr(ServerConfig.load(str(bad)), field) == 3 << 20
    for value in (0, -1, 2.5, "8", True):
        bad.write_text(json.dumps({"max_partial_heads_per_peer": value}))
        with pytest.raises(InvalidSpec, match="max_partial_heads_per_peer"):
            ServerConfig.load(str(bad))
    bad.write_text(json.dumps({"max_partial_heads_per_peer": 3}))
    assert ServerConfig.load(str(bad)).max_partial_heads_per_peer == 3
    assert ServerConfig().max_partial_heads_per_peer == 8
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.1")


def test_partial_heads_are_counted_per_address_and_per_ipv6_64() -> None:
    """An IPv6 host is given a /64 and may use any address in it: counted per address, its
    connections would each be a peer of their own."""
    from corral.server.heads import peer_of

    assert peer_of("192.0.2.1") == "192.0.2.1" != peer_of("192.0.2.2")
    assert peer_of("::ffff:192.0.2.1") == "192.0.2.1"  # (a dual-stack socket's IPv4 client)
    assert peer_of("2001:db8::1") == peer_of("2001:db8::ffff:1") == "2001:db8::/64"
    assert peer_of("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert peer_of("::1") == "::/64"


def test_serve_runs_on_uvloop_and_httptools() -> None:
    """``corral serve`` leaves uvicorn's loop and HTTP parser on "auto": both must resolve to the
    fast ones, which are the server's dependencies (without them: asyncio's loop and h11)."""
    import uvloop
    from uvicorn.config import Config
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert AutoHTTPProtocol is HttpToolsProtocol
    factory = Config(app=lambda *_: None, loop="auto").get_loop_factory()
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_serve_keeps_the_start_up_heap_out_of_the_collector() -> None:
    import gc

    from corral.server import GC_YOUNG_THRESHOLD, settle_garbage_collector

    before = gc.get_threshold()
    try:
        settle_garbage_collector()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
