"""An engine process for connector tests: `python -m tests.engine_proc MODEL_DIR STORE_URL N_TOKENS`.
Generates greedily for prompt 1..N_TOKENS with the tierd connector, waits for its stores, and
prints `OK <tokens> <cached>`."""

import sys

from tierd.engine import LLM, SamplingParams


def main() -> int:
    model, url, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model, kv_cache_bytes="8MiB", kv_store=url, kv_block_tokens=64)
    out = llm.generate(prompt_token_ids=list(range(1, n + 1)),
                       sampling_params=SamplingParams(temperature=0, max_tokens=8))[0]
    llm.close()
    print("OK", ",".join(map(str, out.outputs[0].token_ids)), out.num_cached_tokens, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
