"""config_cls.from_extra (kvhal.integrations.vllm) without vLLM installed: the module needs only vLLM's
connector base classes at import, so a stub of that one module stands in for them here; the connector itself is
tested against the real engine in tests/vllm."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvhal

pytest.importorskip("torch")  # the module imports torch


@pytest.fixture
def config_cls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        yield importlib.import_module("kvhal.integrations.vllm").ConnectorConfig
        return
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorBase_V1 = type("KVConnectorBase_V1", (), {})  # type: ignore[attr-defined]
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})  # type: ignore[attr-defined]
    parts = base.__name__.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    integrations = importlib.import_module("kvhal.integrations")
    assert "kvhal.integrations.vllm" not in sys.modules
    try:
        yield importlib.import_module("kvhal.integrations.vllm").ConnectorConfig
    finally:  # no module built on the stub outlives the test
        sys.modules.pop("kvhal.integrations.vllm", None)
        if hasattr(integrations, "vllm"):
            delattr(integrations, "vllm")


def test_sizes_take_numpy_ints_and_store_plain_ints(config_cls: Any) -> None:
    cfg = config_cls.from_extra({"host_max_bytes": np.int64(1 << 20)})
    assert cfg.host_max_bytes == 1 << 20 and type(cfg.host_max_bytes) is int
    cfg = config_cls.from_extra({"disk_path": "/tmp/x", "disk_max_bytes": np.uint32(1 << 30)})
    assert cfg.disk_max_bytes == 1 << 30 and type(cfg.disk_max_bytes) is int
    assert config_cls.from_extra({"disk_path": "/tmp/x"}).disk_max_bytes > 0
    for bad in (True, np.bool_(True), 0, -1, 1.5, "1GB"):
        with pytest.raises(kvhal.SpecError, match="positive int"):
            config_cls.from_extra({"host_max_bytes": bad})


def test_extra_must_be_a_mapping(config_cls: Any) -> None:
    for bad in ("abc", 5, [("host_max_bytes", 1024)]):
        with pytest.raises(kvhal.SpecError, match="must be a dict"):
            config_cls.from_extra(bad)
    with pytest.raises(kvhal.SpecError, match="unknown key"):
        config_cls.from_extra({1: 2, "host_max_bytes": 1024})  # keys of mixed types are named, not sorted


@pytest.mark.parametrize("key", ["format", "disk_path", "model_id", "redis_url"])
def test_empty_strings_are_refused(config_cls: Any, key: str) -> None:
    with pytest.raises(kvhal.SpecError, match=f"'{key}'.*empty string"):
        config_cls.from_extra({"host_max_bytes": 1024, key: ""})


def test_disk_max_bytes_needs_a_disk_path(config_cls: Any) -> None:
    with pytest.raises(kvhal.SpecError, match="disk_max_bytes but no disk_path"):
        config_cls.from_extra({"host_max_bytes": 1024, "disk_max_bytes": 1 << 30})
    cfg = config_cls.from_extra({"host_max_bytes": 1024, "format": "q8_0", "model_id": "m"})
    assert (cfg.disk_path, cfg.redis_url, cfg.format, cfg.model_id) == (None, None, "q8_0", "m")
