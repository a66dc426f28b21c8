"""One vLLM decode step's time at a batch size, stock vLLM against a kvpolicy recipe (run in the vLLM environment).

N requests of 400 prompt tokens (CPython's docs) decode 64 tokens together with no KV limit, so the batch stays N;
a token budget of 300 makes a recipe evict at the prompt's end. The step time is (time for 66 new tokens - time for
2) / 64. This separates what batching costs the model itself (its linear layers) from what kvpolicy's attention
adds, which `kvpolicy.integrations.vllm.capacity` measures only together:

    .venv-vllm/bin/python benchmarks/vllm_step.py --recipe full --requests 3 --dtype float32
    .venv-vllm/bin/python benchmarks/vllm_step.py --recipe h2o --requests 9 --dtype float32
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="h2o", help="`full`: vLLM without kvpolicy; else a kvpolicy policy name")
    parser.add_argument("--requests", type=int, default=9)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default=str(Path.home() / ".cache" / "kvpolicy" / "smollm2-135m-instruct"))
    args = parser.parse_args()
    from pydoc_data.topics import topics

    from vllm import LLM, SamplingParams

    extra = {} if args.recipe == "full" else {"additional_config": {"kvpolicy": {"recipe": {
        "kvpolicy": 1, "policy": args.recipe, "budget": {"tokens": 300}}}}}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, block_size=32, num_gpu_blocks_override=400,
              enable_prefix_caching=False, max_num_seqs=max(16, args.requests), **extra)
    ids = llm.get_tokenizer()(" ".join(topics[k] for k in sorted(topics)))["input_ids"]
    prompts = [{"prompt_token_ids": ids[i * 1000 : i * 1000 + 400]} for i in range(args.requests)]

    def seconds(new_tokens: int) -> float:
        begin = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0))
        return time.perf_counter() - begin

    seconds(1)  # warm-up
    short, long = seconds(2), seconds(66)
    step = (long - short) / 64
    print(f"{args.recipe}, {args.requests} requests, {args.dtype}: decode step {step * 1e3:.0f} ms, "
          f"{args.requests / step:.1f} tokens/s")


if __name__ == "__main__":
    main()
