"""Run one vLLM engine (its own process) over token-id prompts and write what it produced.

Used by the e2e tests so that every engine is an independently started
process (its own PYTHONHASHSEED, its own connector instances)::

    python engine_run.py --model DIR --prompts prompts.json --out result.json \
        [--servers 127.0.0.1:P1,127.0.0.1:P2] [--chunk-tokens N] [--mp] [--pause] \
        [--prefix-caching] [--kv-cache-mb 256] [--max-model-len 4096] [--batch] [--extra JSON] [--tp N]
        [--reload-before I --reload-path DIR [--reload-mode refresh|reset]]

A prompt is a list of token ids or ``{"tokens": [...], "cache_salt": "..."}``.
``--batch`` submits all prompts in one ``generate`` call (they run concurrently).
``--reload-before I``: before prompt ``I``, replace the running engine's weights in place with
``--reload-path``'s (vLLM's ``reload_weights``, as an RL driver does), then ``refresh``: run
``kvfabric_vllm.weights.refresh_weights_version`` on the workers and reset the prefix cache with
the connector's; ``reset``: the workers were given the model once at start
(``refresh_weights_version``), the update only resets (``reset_connector=True``).

``result.json``: ``{"outputs": [[token ids]...], "cached": [num_cached_tokens...],
"counters": {...} | null, "counters_after": [{...} per prompt] | null, "fingerprints": [[per rank]
per refresh_weights_version run]}``. Counters
are the connector's (``kvfabric_vllm.metrics``), readable only when the engine
runs in this process (no ``--mp``).
Exit status is non-zero (with vLLM's traceback) if the engine fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


# The connector's deadlines are latency budgets for a live engine (a 20 ms inline wait for a
# lookup, 1 s before it counts as a miss, 2 s for a load): on a test machine at load 20 a
# healthy pool can miss them, and what a test then sees (a save sent unchecked, a hit
# recomputed) depends on the scheduler, not on the code under test. Tests wait for their
# pool instead; a test of the deadlines themselves sets them again with --extra. The same holds
# for shutdown: the saves' drain (3 s) and vLLM's grace before it kills the engine core process
# (5 s after SIGTERM) are both given a minute here, so a test that reads the connector's shutdown
# line or counts the saves a shutdown flushed does not depend on how loaded the machine is.
UNHURRIED = {"lookup_timeout_ms": 60_000, "lookup_wait_ms": 60_000, "load_timeout_s": 60.0, "save_timeout_s": 60.0,
             "shutdown_drain_s": 60.0}
SHUTDOWN_GRACE_S = 60.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--servers", default="")
    ap.add_argument("--chunk-tokens", type=int, default=0, help="0: the connector's default (vLLM's block)")
    ap.add_argument("--role", default="kv_both", choices=["kv_both", "kv_producer", "kv_consumer"])
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--mp", action="store_true", help="vLLM's default multi-process engine core")
    ap.add_argument("--pause", action="store_true",
                    help="before each prompt after the first, print 'KVF-PAUSE i' and wait for a line on stdin")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's local prefix cache on")
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--batch", action="store_true", help="all prompts in one generate call")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config keys (JSON)")
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (workers in child processes)")
    ap.add_argument("--reload-before", type=int, default=-1, help="update the weights in place before prompt I")
    ap.add_argument("--reload-path", default="", help="the model directory whose weights --reload-before loads")
    ap.add_argument("--reload-mode", default="refresh", choices=["refresh", "reset"])
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.mp else "0"

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if args.servers:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVFabricConnector",
            "kv_connector_module_path": "kvfabric_vllm.connector",
            "kv_role": args.role,
            "kv_connector_extra_config": {"servers": args.servers.split(","),
                                          **({"chunk_tokens": args.chunk_tokens} if args.chunk_tokens else {}),
                                          **UNHURRIED, **json.loads(args.extra)},
        }
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, enable_prefix_caching=args.prefix_caching,
              kv_cache_memory_bytes=args.kv_cache_mb << 20, max_model_len=args.max_model_len,
              max_num_batched_tokens=1024, seed=0, **({"enable_lora": True} if args.enable_lora else {}),
              **({"tensor_parallel_size": args.tp} if args.tp > 1 else {}), **kw)
    with open(args.prompts) as f:
        prompts = json.load(f)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else
              TokensPrompt(prompt_token_ids=p["tokens"], cache_salt=p["cache_salt"]) for p in prompts]
    snapshot = None
    if args.servers and not args.mp:
        from kvfabric_vllm.metrics import all_counters as snapshot
    fingerprints = []
    if args.reload_before >= 0 and args.reload_mode == "reset":
        from kvfabric_vllm.weights import refresh_weights_version

        fingerprints.append(llm.collective_rpc(refresh_weights_version))   # the model, given once
    outputs, cached, counters_after = [], [], []
    batches = [inputs] if args.batch else [[p] for p in inputs]
    for i, batch in enumerate(batches):   # one at a time: each lookup sees the previous saves
        if args.pause and i:
            print(f"KVF-PAUSE {i}", flush=True)
            sys.stdin.readline()
        if i == args.reload_before:      # an RL weight update on the running engine
            llm.collective_rpc("reload_weights", kwargs={"weights_path": args.reload_path})
            if args.reload_mode == "refresh":
                from kvfabric_vllm.weights import refresh_weights_version

                fingerprints.append(llm.collective_rpc(refresh_weights_version))
            assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        for res in llm.generate(batch, params, use_tqdm=False):
            outputs.append(list(res.outputs[0].token_ids))
            cached.append(res.num_cached_tokens or 0)
        if snapshot is not None:
            counters_after.append(snapshot())
    counters = snapshot() if snapshot is not None else None
    # Shut the engine down here so the connector's pending saves are flushed
    # (its shutdown waits for them) before this process reports and exits.
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
    with open(args.out, "w") as f:
        json.dump({"outputs": outputs, "cached": cached, "counters": counters,
                   "counters_after": counters_after if snapshot is not None else None,
                   "fingerprints": fingerprints}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
