"""One vLLM decode step's time at a batch size, stock vLLM against a kvpolicy recipe (run in the vLLM environment).

N requests of ``--prompt-tokens`` prompt tokens (CPython's docs) decode 64 tokens together with no KV limit, so the
batch stays N; a recipe (a built-in name or YAML file; the built-in ones keep 20% of the prompt) evicts at the
prompt's end and then once a block. Once every request decodes, each engine step is timed alone (``--steps`` of
them): what a decode step costs at that batch, kvpolicy's part (score pass, compactions) included, which
`kvpolicy.integrations.vllm.capacity` measures only together with admission. Prints the median and the mean (the
mean includes the steps that compact):

    .venv-vllm/bin/python benchmarks/vllm_step.py --recipes full streaming h2o --requests 12 --dtype float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["full", "streaming", "h2o"],
                        help="`full`: vLLM without kvpolicy; else kvpolicy recipes (names or YAML paths)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per recipe")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default=str(Path.home() / ".cache" / "kvpolicy" / "smollm2-135m-instruct"))
    args = parser.parse_args()
    if len(args.recipes) > 1:  # one process each: an engine torn down late would take the next one's process groups
        for recipe in args.recipes:
            argv = [a for a in sys.argv[1:]]
            at = argv.index("--recipes") if "--recipes" in argv else None
            if at is not None:
                end = at + 1
                while end < len(argv) and not argv[end].startswith("--"):
                    end += 1
                del argv[at:end]
            subprocess.run([sys.executable, __file__, *argv, "--recipes", recipe], check=True)
        return
    from pydoc_data.topics import topics

    from vllm import LLM, SamplingParams

    from kvpolicy.integrations.vllm.capacity import block_bytes

    # the KV memory of exactly these blocks (vLLM's CPU worker otherwise asks for a share of the machine's RAM)
    page_bytes = block_bytes(argparse.Namespace(model=Path(args.model), dtype=args.dtype, block_size=32))
    ids = None
    for recipe in args.recipes:
        extra = {} if recipe == "full" else {"additional_config": {"kvpolicy": {"recipe": recipe}}}
        blocks = args.requests * -(-(args.prompt_tokens + 80) // 32) + 8
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.prompt_tokens + 128, block_size=32,
                  num_gpu_blocks_override=blocks, kv_cache_memory_bytes=(blocks + 1) * page_bytes,
                  enable_prefix_caching=False, max_num_seqs=args.requests, **extra)
        if ids is None:
            ids = llm.get_tokenizer()(" ".join(topics[k] for k in sorted(topics)))["input_ids"]
        stride = (len(ids) - args.prompt_tokens) // args.requests
        prompts = [{"prompt_token_ids": ids[i * stride: i * stride + args.prompt_tokens]} for i in range(args.requests)]

        engine = llm.llm_engine
        params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0)
        for index, prompt in enumerate(prompts):
            engine.add_request(f"{recipe}-{index}", prompt, params)
        started: set[str] = set()
        while len(started) < len(prompts):  # the prompts, and each request's first token
            started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
        times = []
        for _ in range(args.steps):
            begin = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - begin)
        while engine.has_unfinished_requests():
            engine.step()
        median, mean = statistics.median(times), statistics.mean(times)
        print(f"{recipe}, {args.requests} requests x {args.prompt_tokens} tokens, {args.dtype}: decode step median "
              f"{median * 1e3:.1f} ms, mean {mean * 1e3:.1f} ms over {args.steps} steps, "
              f"{args.requests / median:.1f} tokens/s", flush=True)
        del llm


if __name__ == "__main__":
    main()
