"""A load test of vLLM's OpenAI-compatible server, stock and with kvpolicy recipes (run in the vLLM environment).

Per configuration, one server (``python -m vllm.entrypoints.openai.api_server``, SmolLM2 in float32) with a small,
fixed KV cache (``--kv-blocks`` blocks of 32 tokens) takes ``--requests`` completions, ``--concurrency`` at a time:
token-id prompts of mixed lengths cut from CPython's docs, each sent several times, half of them streamed, and a
share of the streamed ones dropped by the client mid-stream. It measures the requests completed / failed / aborted,
vLLM's preemptions, time to first token and per-token latency (streamed requests), throughput, the KV blocks still
held once the load has drained, the server's memory (RSS of its process tree) after warm-up, each time a tenth of
the requests has ended, and at the end (flat: the end within 5% of the sample after the load's first fifth), and
whether each greedy answer equals the answer to the same prompt sent alone to the same server afterwards (for an
aborted request: is a prefix of it):

    .venv-vllm/bin/python benchmarks/vllm_load.py --configs stock h2o

A configuration is ``stock`` (vLLM without kvpolicy), a recipe name or YAML path, ``NAME:key=value,...`` (keys of
the kvpolicy entry; values read as JSON when they parse, e.g. ``h2o:budget=0.2``) or the whole entry as JSON. Prints
a table and writes ``results.jsonl`` (a row per configuration), ``requests.jsonl`` and the server logs into
``--out``. Exits non-zero if a configuration had failed requests, differing answers or blocks held at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil  # a dependency of vLLM itself, so always in its environment

DEFAULT_MODEL = Path(os.environ.get("KVPOLICY_CACHE", Path.home() / ".cache" / "kvpolicy")) / "smollm2-135m-instruct"
BLOCK_SIZE = 32
ABORT_AFTER_CHUNKS = 8  # token chunks a dropped stream receives before the client closes its connection
START_TIMEOUT_S = 400  # a busy 2-core CPU takes 40-130 s to load the model and profile it
REQUEST_TIMEOUT_S = 1800
MIB = 1 << 20
READ_METRICS = ("vllm:num_preemptions_total", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                "vllm:num_requests_waiting")
METRIC_LINE = re.compile(r"^(vllm:[\w:]+)(?:\{.*\})?\s+(\S+)$")


@dataclass
class Config:
    label: str  # as the user wrote it
    kvpolicy: dict | None  # vLLM's additional_config["kvpolicy"]; None: stock vLLM


@dataclass
class Outcome:
    index: int
    prompt: int  # index of the distinct prompt
    stream: bool
    drop: bool  # the client closes the stream mid-way
    status: str = "completed"  # or "failed", "aborted"
    error: str | None = None
    ttft_s: float | None = None
    ttft_is_total: bool = False  # non-streamed: the first token arrives with the last
    per_token_s: float | None = None
    latency_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    matches_alone: bool | None = None


class ServerError(RuntimeError):
    pass


def parse_config(text: str) -> Config:
    if text == "stock":
        return Config(text, None)
    if text.lstrip().startswith("{"):
        entry = json.loads(text)
        if not isinstance(entry, dict) or "recipe" not in entry:
            raise ValueError(f"{text!r}: a JSON configuration is the kvpolicy entry, with a 'recipe' key")
        return Config(text, entry)
    name, _, options = text.partition(":")
    # a YAML path made absolute: the results then name the file unambiguously
    entry: dict = {"recipe": str(Path(name).resolve()) if Path(name).is_file() else name}
    for option in filter(None, options.split(",")):
        key, equals, value = option.partition("=")
        if not equals:
            raise ValueError(f"{text!r}: {option!r} is not key=value")
        try:
            entry[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            entry[key.strip()] = value.strip()
    return Config(text, entry)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a local Hugging Face model folder")
    parser.add_argument("--configs", nargs="+", default=["stock", "h2o"],
                        help="`stock`, or a recipe: NAME | YAML path | NAME:key=value,... | JSON kvpolicy entry")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--distinct", type=int, default=40, help="distinct prompts; request i sends i %% distinct")
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=[200, 1400], metavar=("MIN", "MAX"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--abort-share", type=float, default=0.1, help="share of all requests dropped mid-stream")
    parser.add_argument("--kv-blocks", type=int, default=68,
                        help="KV blocks of 32 tokens, vLLM's null block among them (small enough that stock vLLM "
                             "preempts at the default load)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--port", type=int, help="the server's port (default: a free one)")
    parser.add_argument("--text", type=Path, help="the prompts' text (default: CPython's pydoc_data.topics)")
    parser.add_argument("--out", type=Path, default=Path("runs") / f"vllm-load-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="one more argument for the server, repeatable (e.g. --server-arg=--max-num-seqs=8)")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there")
    for name in ("requests", "concurrency", "distinct", "new_tokens", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= args.prompt_lengths[0] <= args.prompt_lengths[1]:
        parser.error("--prompt-lengths: 1 <= MIN <= MAX")
    if not 0 <= args.abort_share <= 0.5:
        parser.error("--abort-share must be within [0, 0.5] (only streamed requests, half of them, are dropped)")
    if args.kv_blocks < 2:
        parser.error("--kv-blocks must be >= 2")
    try:
        args.configs = [parse_config(text) for text in args.configs]
    except ValueError as exc:
        parser.error(f"--configs: {exc}")
    return args


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``--distinct`` prompts, lengths spread evenly over ``--prompt-lengths``, from different offsets of the text."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    if args.text is not None:
        text = args.text.read_text(encoding="utf-8", errors="replace")
    else:
        import pydoc_data.topics

        text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    logging.set_verbosity_error()  # the text is longer than the model's context; it is only cut into prompts
    ids = AutoTokenizer.from_pretrained(args.model)(text, add_special_tokens=False)["input_ids"]
    shortest, longest = args.prompt_lengths
    lengths = [round(shortest + (longest - shortest) * i / max(1, args.distinct - 1)) for i in range(args.distinct)]
    random.Random(0).shuffle(lengths)  # so that every wave of concurrent requests mixes short and long prompts
    stride = (len(ids) - longest) // args.distinct
    if stride < 1:
        raise SystemExit(f"the text has {len(ids)} tokens: too few for {args.distinct} prompts of up to {longest}")
    return [ids[i * stride: i * stride + length] for i, length in enumerate(lengths)]


def dropped_requests(requests: int, share: float) -> set[int]:
    """The requests the client drops: every 1/share-th, spread evenly over the streamed (even-numbered) ones."""
    streamed = list(range(0, requests, 2))
    count = min(len(streamed), round(share * requests))
    return {streamed[int((k + 0.5) * len(streamed) / count)] for k in range(count)}


def kv_block_bytes(model: Path) -> int:
    """K and V of one block of every layer, float32: the page size vLLM sizes its cache in."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * BLOCK_SIZE * 4


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One vLLM server in its own process group, its output in ``log_path``."""

    def __init__(self, args: argparse.Namespace, config: Config, port: int, log_path: Path) -> None:
        blocks = args.kv_blocks
        self.url, self.log_path = f"http://127.0.0.1:{port}", log_path
        self.command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
            "--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(blocks),
            # the bytes of these blocks (and one spare): unsized, the CPU build takes a share of the machine's RAM
            "--kv-cache-memory-bytes", str((blocks + 1) * kv_block_bytes(args.model)),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(max(1536, args.prompt_lengths[1] + args.new_tokens)),
            "--port", str(port), "--host", "127.0.0.1", "--seed", "0"]
        if config.kvpolicy is not None:
            self.command += ["--additional-config", json.dumps({"kvpolicy": config.kvpolicy})]
        self.command += args.server_arg
        self.process: subprocess.Popen | None = None

    def start(self) -> float:
        """Start the server; the seconds until ``/health`` answers."""
        start = time.monotonic()
        with self.log_path.open("w") as log:
            log.write(" ".join(self.command) + "\n\n")
            log.flush()
            # its own session: Ctrl-C here does not reach it half-way, and stop() can signal all of its processes
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        while time.monotonic() - start < START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise ServerError(f"the server exited ({self.process.returncode}) before it was ready; its last "
                                  f"line: {self.log_lines()[-1]}\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except OSError:  # not listening yet
                pass
            time.sleep(2)
        raise ServerError(f"the server did not answer /health within {START_TIMEOUT_S} s:\n{self.tail()}")

    def log_lines(self) -> list[str]:
        return [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]

    def tail(self, lines: int = 40) -> str:
        return "\n".join(f"    {line}" for line in self.log_lines()[-lines:]) + f"\n(the whole log: {self.log_path})"

    def memory_mib(self) -> dict[str, float]:
        """RSS summed over the server and its descendants (the engine core runs in a child), and PSS, which counts
        memory the processes share once."""
        rss = pss = 0
        root = psutil.Process(self.process.pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                info = process.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss += info.rss
            pss += getattr(info, "pss", 0)
        return {"rss": round(rss / MIB, 1), "pss": round(pss / MIB, 1)}

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus metrics, each summed over its labels."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if match := METRIC_LINE.match(line):
                totals[match[1]] = totals.get(match[1], 0.0) + float(match[2])
        return totals

    def stop(self) -> None:
        """SIGINT to the process group (vLLM then shuts its engine down), SIGKILL to whatever is left after 60 s."""
        if self.process is None:
            return
        try:
            root = psutil.Process(self.process.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGINT)
        _, alive = psutil.wait_procs(family, timeout=60)
        if alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            for process in alive:  # also a descendant that left the group
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            psutil.wait_procs(alive, timeout=10)
        self.process.wait()
        self.process = None


def request_body(model: str, prompt: list[int], new_tokens: int, stream: bool) -> dict:
    # return_token_ids: the answer's token ids (a streamed chunk carries its new ones), so answers compare exactly
    return {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": None, "stream": stream, "return_token_ids": True}


async def send(session: aiohttp.ClientSession, server: Server, body: dict, outcome: Outcome) -> None:
    """One completion, recorded into ``outcome``; a dropped one is closed after ABORT_AFTER_CHUNKS token chunks."""
    start = time.perf_counter()
    try:
        async with session.post(f"{server.url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise ServerError(f"HTTP {response.status}: {(await response.text())[:300]}")
            if not body["stream"]:
                outcome.token_ids = (await response.json())["choices"][0]["token_ids"]
                outcome.latency_s = outcome.ttft_s = time.perf_counter() - start
                outcome.ttft_is_total = True
            else:
                chunks, first, last = 0, 0.0, 0.0
                async for line in response.content:  # server-sent events: "data: {json}" lines, "data: [DONE]"
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    message = json.loads(line[len(b"data: "):])
                    if "error" in message:
                        raise ServerError(f"error mid-stream: {message['error']}")
                    new_ids = message["choices"][0].get("token_ids") or []
                    if not new_ids:  # e.g. the last chunk, which only says why the answer finished
                        continue
                    last = time.perf_counter()
                    first = first or last
                    outcome.token_ids += new_ids
                    chunks += 1
                    if outcome.drop and chunks == min(ABORT_AFTER_CHUNKS, max(1, body["max_tokens"] // 2)):
                        outcome.status = "aborted"
                        response.close()  # drops the connection: the server sees the client gone and aborts
                        break
                outcome.latency_s = time.perf_counter() - start
                if first:
                    outcome.ttft_s = first - start
                if outcome.status == "completed" and len(outcome.token_ids) > 1:
                    outcome.per_token_s = (last - first) / (len(outcome.token_ids) - 1)
        if outcome.status == "completed" and len(outcome.token_ids) != body["max_tokens"]:
            raise ServerError(f"{len(outcome.token_ids)} tokens of {body['max_tokens']}")
    except Exception as exc:  # recorded per request: the load goes on
        outcome.status, outcome.error = "failed", f"{type(exc).__name__}: {exc}"[:500]


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    at = share * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def rounded(value: float | None, scale: float = 1.0, digits: int = 3) -> float | None:
    return None if value is None else round(value * scale, digits)


async def measure(server: Server, config: Config, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Warm-up, the load, metrics and memory, then every distinct prompt alone: the configuration's summary row,
    its per-request outcomes under ``"outcomes"``."""
    model, usable_blocks = str(args.model), args.kv_blocks - 1  # vLLM keeps one block as its null block
    drop = dropped_requests(args.requests, args.abort_share)
    outcomes = [Outcome(i, i % len(prompts), stream=i % 2 == 0, drop=i in drop) for i in range(args.requests)]
    slots = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        warm = [Outcome(-1, 0, stream=s, drop=False) for s in (True, False)]
        await asyncio.gather(*(send(session, server, request_body(model, prompts[0][:64], 8, o.stream), o)
                               for o in warm))
        if any(o.status != "completed" for o in warm):
            raise ServerError(f"the warm-up failed: {[o.error for o in warm]}")
        memory_warm = server.memory_mib()
        # the server's memory each time another tenth of the requests has ended: a leak grows with the requests
        # served, while allocator pools and caches settle during the load's first part
        trajectory: list[dict] = []
        ended = 0

        async def in_turn(outcome: Outcome) -> None:
            nonlocal ended
            async with slots:  # FIFO: each request starts as soon as one before it is done
                body = request_body(model, prompts[outcome.prompt], args.new_tokens, outcome.stream)
                await send(session, server, body, outcome)
            ended += 1
            if ended * 10 // len(outcomes) > len(trajectory):
                trajectory.append({"requests_ended": ended, **server.memory_mib()})

        start = time.perf_counter()
        await asyncio.gather(*(in_turn(outcome) for outcome in outcomes))
        seconds = time.perf_counter() - start
        await asyncio.sleep(2)  # aborts of dropped streams reach the engine
        # vLLM publishes KV usage with each engine step only: if the load's last act was an abort, the gauge is
        # still that of the step before it. One tiny request makes a step that ends with nothing held.
        probe = Outcome(-2, 0, stream=False, drop=False)
        await send(session, server, request_body(model, prompts[0][:1], 1, False), probe)
        metrics_end, memory_end = server.metrics(), server.memory_mib()
        missing = [name for name in READ_METRICS if name not in metrics_end]
        if missing:  # else they would read as zero
            raise ServerError(f"the server's /metrics has no {', '.join(missing)}")

        alone = [Outcome(-3, p, stream=False, drop=False) for p in range(min(len(prompts), args.requests))]
        for outcome in alone:
            await send(session, server, request_body(model, prompts[outcome.prompt], args.new_tokens, False), outcome)
        metrics_after_alone = server.metrics()

    answers = {o.prompt: o.token_ids for o in alone if o.status == "completed"}
    for outcome in outcomes:
        reference = answers.get(outcome.prompt)
        if outcome.status != "failed" and reference is not None:
            outcome.matches_alone = (outcome.token_ids == reference if outcome.status == "completed"
                                     else outcome.token_ids == reference[:len(outcome.token_ids)])
    streamed = [o for o in outcomes if o.stream and o.status == "completed"]
    count = {status: sum(o.status == status for o in outcomes) for status in ("completed", "failed", "aborted")}
    compared = [o for o in outcomes if o.matches_alone is not None]
    output_tokens = sum(len(o.token_ids) for o in outcomes)
    return {
        "config": config.label, "kvpolicy": config.kvpolicy, "kv_blocks": args.kv_blocks, "requests": args.requests,
        "concurrency": args.concurrency, "distinct": len(prompts), "new_tokens": args.new_tokens, **count,
        "failures": [f"#{o.index}: {o.error}" for o in outcomes if o.status == "failed"][:10],
        "alone_failed": [f"prompt {o.prompt}: {o.error}" for o in alone if o.status != "completed"],
        "preemptions": int(metrics_end.get("vllm:num_preemptions_total", 0)),
        "ttft_p50_s": rounded(percentile([o.ttft_s for o in streamed], 0.5)),
        "ttft_p99_s": rounded(percentile([o.ttft_s for o in streamed], 0.99)),
        "per_token_p50_ms": rounded(percentile([o.per_token_s for o in streamed if o.per_token_s], 0.5), 1e3, 1),
        "per_token_p99_ms": rounded(percentile([o.per_token_s for o in streamed if o.per_token_s], 0.99), 1e3, 1),
        "seconds": round(seconds, 1), "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / seconds, 1),
        "blocks_held_at_end": round(metrics_end.get("vllm:kv_cache_usage_perc", 0) * usable_blocks),
        "blocks_held_after_alone": round(metrics_after_alone.get("vllm:kv_cache_usage_perc", 0) * usable_blocks),
        "running_at_end": int(metrics_end.get("vllm:num_requests_running", 0)),
        "waiting_at_end": int(metrics_end.get("vllm:num_requests_waiting", 0)),
        "rss_warm_mib": memory_warm["rss"], "rss_end_mib": memory_end["rss"],
        "rss_change_pct": round(100 * (memory_end["rss"] / memory_warm["rss"] - 1), 1),
        "pss_warm_mib": memory_warm["pss"], "pss_end_mib": memory_end["pss"],
        # from the sample after the load's first fifth (the load's own warm-up: every prompt length seen) to the end
        "rss_fifth_mib": trajectory[1]["rss"] if len(trajectory) > 1 else None,
        "rss_change_after_fifth_pct": (round(100 * (memory_end["rss"] / trajectory[1]["rss"] - 1), 1)
                                       if len(trajectory) > 1 else None),
        "memory_trajectory": trajectory,
        "differing": sum(not o.matches_alone for o in compared), "compared": len(compared),
        "differing_requests": [f"#{o.index} ({o.status}, prompt {o.prompt})" for o in compared if not o.matches_alone],
        "outcomes": [asdict(o) for o in outcomes],
    }


def print_table(rows: list[dict]) -> None:
    header = ["config", "done/failed/aborted", "preempt", "TTFT p50/p99 s", "tok p50/p99 ms", "seconds", "out tok/s",
              "held blocks", "RSS warm/end MiB (change)", "RSS 1/5/end (change)", "differing"]
    lines = [header]
    for row in rows:
        if "error" in row:
            lines.append([row["config"], "server failed: see above"] + [""] * (len(header) - 2))
            continue
        lines.append([
            row["config"], f"{row['completed']}/{row['failed']}/{row['aborted']}", str(row["preemptions"]),
            f"{row['ttft_p50_s']}/{row['ttft_p99_s']}", f"{row['per_token_p50_ms']}/{row['per_token_p99_ms']}",
            str(row["seconds"]), str(row["output_tokens_per_s"]), str(row["blocks_held_at_end"]),
            f"{row['rss_warm_mib']:.0f}/{row['rss_end_mib']:.0f} ({row['rss_change_pct']:+.1f}%)",
            (f"{row['rss_fifth_mib']:.0f}/{row['rss_end_mib']:.0f} ({row['rss_change_after_fifth_pct']:+.1f}%)"
             if row["rss_fifth_mib"] is not None else "-"),
            f"{row['differing']}/{row['compared']}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print(" | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


def problems_of(row: dict) -> list[str]:
    if "error" in row:
        return [f"{row['config']}: {row['error'].splitlines()[0]}"]
    found = []
    if row["failed"] or row["alone_failed"]:
        found.append(f"{row['config']}: {row['failed']} failed requests {row['failures'][:3]}"
                     + (f", alone: {row['alone_failed'][:3]}" if row["alone_failed"] else ""))
    if row["differing"]:
        found.append(f"{row['config']}: {row['differing']} answers differ from the prompt's alone: "
                     + ", ".join(row["differing_requests"][:10]))
    if row["blocks_held_at_end"] or row["blocks_held_after_alone"]:
        found.append(f"{row['config']}: KV blocks held once idle: {row['blocks_held_at_end']} after the load, "
                     f"{row['blocks_held_after_alone']} after the alone answers")
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a plain `kill` ends this script through its finally blocks too, so no server is left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    prompts = make_prompts(args)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("results.jsonl", "requests.jsonl"):  # written a configuration at a time, appending
        (args.out / name).unlink(missing_ok=True)
    print(f"{args.requests} requests at concurrency {args.concurrency}: {len(prompts)} distinct prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.new_tokens} new tokens, "
          f"{len(dropped_requests(args.requests, args.abort_share))} dropped mid-stream; {args.kv_blocks} KV blocks "
          f"of {BLOCK_SIZE}; writing to {args.out}", flush=True)
    rows = []
    for number, config in enumerate(args.configs):
        port = args.port or free_port()
        with socket.socket() as probe:  # a server already there would answer /health in place of ours
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                raise SystemExit(f"port {port} is in use")
        file_label = re.sub(r"[^\w.-]+", "_", config.label)[:60]
        log_path = args.out / f"server-{number}-{file_label}.log"
        server = Server(args, config, port, log_path)
        print(f"\n[{config.label}] starting the server (log: {log_path})", flush=True)
        try:
            start_s = server.start()
            print(f"[{config.label}] ready after {start_s:.0f} s; warm-up, load, alone answers", flush=True)
            row = {**asyncio.run(measure(server, config, prompts, args)), "server_start_s": round(start_s, 1)}
        except (ServerError, OSError, psutil.Error) as exc:  # OSError, psutil.Error: the server died mid-way
            print(f"[{config.label}] {type(exc).__name__}: {exc}", file=sys.stderr)
            row = {"config": config.label, "kvpolicy": config.kvpolicy, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            server.stop()
        with (args.out / "requests.jsonl").open("a") as file:
            for outcome in row.pop("outcomes", []):
                file.write(json.dumps({"config": config.label, **outcome}) + "\n")
        with (args.out / "results.jsonl").open("a") as file:
            file.write(json.dumps(row) + "\n")
        rows.append(row)
    print()
    print_table(rows)
    problems = [problem for row in rows for problem in problems_of(row)]
    for problem in problems:
        print(f"FAILED {problem}")
    print(f"\nwrote {args.out / 'results.jsonl'}, {args.out / 'requests.jsonl'} and the server logs")
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the server is stopped by then (main's finally)
        sys.exit("interrupted; the configurations finished so far are in --out")
