"""One vLLM process for tests/vllm: greedy generation with the KVHalConnector, results as JSON.

    python tests/vllm/engine_run.py JOB.json OUT.json

JOB: {"model": dir, "prompts": [[token ids], ...], "max_tokens": n, "extra": kv_connector_extra_config,
"warm": [prompt indices run again after all]}; the prompts run one after another.
OUT: per prompt the output token ids and vLLM's num_cached_tokens, the connector's counters, its bytes per token.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the connector's counters are here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# no OpenMP thread pinning: on a shared 2-core CI machine a pinned thread waits for whoever holds its core
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=4,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVHalConnector",
            kv_connector_module_path="kvhal.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=job["extra"],
        ),
    )
    t1 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    # one prompt at a time: greedy tokens are compared across processes, and bf16 numerics depend on the batch
    # (the same prompt batched with others gave another token at a near-tie than alone, in A itself)
    outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0] for p in job["prompts"]]
    # "warm": those prompts again, now over vLLM's own prefix cache (its blocks from the run above): the
    # computation a process that loads the blocks from kvhal runs (the last partial block's prefill, then decode)
    warm = [
        llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][i])], params, use_tqdm=False)[0]
        for i in job.get("warm", [])
    ]
    t2 = time.perf_counter()
    from kvhal.integrations import vllm as connector

    stores = list(connector._STORES.values())
    stats = dataclasses.asdict(stores[0].stats) if stores else None
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "num_cached_tokens": [o.num_cached_tokens for o in outs],
        "warm_outputs": [list(o.outputs[0].token_ids) for o in warm],
        "warm_num_cached_tokens": [o.num_cached_tokens for o in warm],
        "stats": stats,
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "startup_s": round(t1 - t0, 1),
        "generate_s": round(t2 - t1, 1),
    }
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
