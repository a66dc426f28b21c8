"""The ``kvpolicy`` command: generate, compare, bench, profile, validate, policies, recipes."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from ..errors import KVPolicyError
from ..recipe import builtin_recipe_names, load_recipe, with_budget
from ..recipe.budget import parse_budget
from ..registry import get_registry
from .bench import add_bench_arguments, run_bench
from .common import (
    THREADS,
    ArgumentParser,
    add_device_arguments,
    bound_numbers,
    count,
    quiet_torch,
    read_text,
    torch_dtype,
)
from .compare import add_compare_arguments, run_compare
from .profile import params_from_args, profile_model, runtime_recipe

# SmolLM2-135M's shape, so `validate` needs no model load for the embedded default
DEFAULT_SHAPE = (30, 3)


def cmd_generate(args: argparse.Namespace) -> None:
    text, _ = read_text(args.prompt_file, prompt=args.prompt, what="prompt file")
    recipe = load_recipe(args.recipe)
    if args.budget:
        recipe = with_budget(recipe, parse_budget(args.budget))
    with quiet_torch():  # bad input fails above, before transformers loads
        _generate(args, text, recipe)


def _generate(args: argparse.Namespace, text: str, recipe) -> None:
    import torch

    from ..hf.models import load_model
    from ..hf.session import attach

    model, tokenizer = load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    session = attach(model, recipe, tokenizer=tokenizer)
    if args.compile:
        session.compile()
    if args.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt").to(args.device)
    started = time.perf_counter()
    with torch.inference_mode():
        output = session.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    elapsed = time.perf_counter() - started
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    print(tokenizer.decode(new_tokens, skip_special_tokens=True))
    print(f"\n--- {recipe.name}: {inputs['input_ids'].shape[1]} prompt tokens, {len(new_tokens)} generated in {elapsed:.1f} s "
          f"({args.dtype}, {args.device})")
    print(session.plan.describe())
    print(session.last_cache.memory_report())


def _model_shape(name: str) -> tuple[int, int]:
    """(layers, KV heads) of a model alias or local folder, from its config alone (no weights load)."""
    from ..hf.models import _ALIAS_SPELLINGS, model_aliases, resolve_alias

    resolved = resolve_alias(name)
    if resolved.lower() in _ALIAS_SPELLINGS:
        return DEFAULT_SHAPE
    from transformers import AutoConfig

    from ..hf.models import folder_errors, hub_offline, looks_like_hub_id
    from ..hf.session import checked_shape

    folder = Path(resolved).expanduser()
    if not (folder / "config.json").is_file():
        aliases = ", ".join(sorted({"smollm2", *model_aliases()}))
        unknown = f"--model {name!r} is neither a model alias ({aliases}), a local folder with a config.json"
        if not looks_like_hub_id(resolved):
            raise KVPolicyError(f"{unknown}, nor a Hub id (org/name)")
        try:  # a Hub id: its config alone, from the local cache or (downloads allowed) the Hub
            config = AutoConfig.from_pretrained(resolved, local_files_only=hub_offline())
        except (OSError, ValueError):
            raise KVPolicyError(f"{unknown}, nor a Hub id whose config is in the local Hugging Face cache or can be "
                                "downloaded" + (" (downloads are off: HF_HUB_OFFLINE=1)" if hub_offline() else "")) \
                from None
        folder = Path(resolved)
    else:
        with folder_errors(folder):
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    return checked_shape(getattr(config, "num_hidden_layers", None), heads, f"the model in {str(folder)!r}")


def cmd_validate(args: argparse.Namespace) -> None:
    recipe = load_recipe(args.file)
    layers, heads = DEFAULT_SHAPE
    if args.model:
        layers, heads = _model_shape(args.model)
    layers, heads = args.layers or layers, args.kv_heads or heads
    plan = recipe.resolve(layers, heads)
    print(f"{recipe.source}: valid for {layers} layers x {heads} KV heads")
    if recipe.description:
        print(f"  {recipe.description}")
    print(plan.describe())


def cmd_policies(args: argparse.Namespace) -> None:
    registry = get_registry()
    for name in registry.names():
        entry = registry.policies[name]
        needs = ", ".join(sorted(entry.policy.needs)) or "none (plain SDPA)"
        params = ", ".join(f"{field}={spec.default!r}" for field, spec in entry.policy.param_fields().items())
        print(f"{name:<12} [{entry.source}] {entry.policy.description}")
        print(f"{'':<12} params: {params or '-'}; attention statistics: {needs}")
    for plugin, reason in registry.broken.items():
        print(f"broken plugin {plugin}: {reason}")


def cmd_recipes(args: argparse.Namespace) -> None:
    for name in builtin_recipe_names():
        recipe = load_recipe(name)
        budget = "per head" if recipe.policy.dynamic_budget else recipe.budget.describe()  # FastGen: its own
        print(f"{name:<12} budget={budget:<16} {recipe.description}")


def _listed(value: object) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def cmd_profile(args: argparse.Namespace) -> None:
    with quiet_torch(args.threads):
        _profile(args)


def _profile(args: argparse.Namespace) -> None:
    from ..hf.models import load_model

    text, _ = read_text(args.prompt_file, prompt=args.prompt, what="prompt file")
    params = params_from_args(args)
    runtime_recipe(**params)  # bad params fail here, before the model loads
    if args.out.exists() and args.out.is_dir():
        raise KVPolicyError(f"--out {str(args.out)!r} is a folder: give the recipe file to write, e.g. recipe.yaml")
    model, tokenizer = load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    if args.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not args.chat)["input_ids"][0]
    if args.tokens:
        ids = ids[: args.tokens]
    source = Path(args.prompt_file).name if args.prompt_file else "the --prompt text"
    profile = profile_model(model, tokenizer, ids, source=source, model_name=args.model, **params)
    profile.command = shlex.join(["kvpolicy", "profile", "--model", args.model,
                                  *(["--prompt-file", args.prompt_file] if args.prompt_file else []),
                                  *(["--tokens", str(args.tokens)] if args.tokens else []),
                                  *(["--chat"] if args.chat else []),
                                  *(["--device", args.device] if args.device != "cpu" else []),
                                  *(["--dtype", args.dtype] if args.dtype != "float32" else []),
                                  *[part for key, value in params.items()
                                    for part in (f"--{key.replace('_', '-')}", *map(str, _listed(value)))],
                                  "--out", str(args.out)])
    print(profile.summary())
    path = profile.write(args.out, args.name)
    print(f"wrote {path}: `kvpolicy validate {path}` prints its plan; attach it as any recipe")


def cmd_compare(args: argparse.Namespace) -> None:
    run_compare(args)


def cmd_bench(args: argparse.Namespace) -> None:
    run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="kvpolicy", description="KV-cache eviction policies for transformers models")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a recipe and print the KV memory report")
    gen.add_argument("--model", default="smollm2", help="model alias, local Hugging Face folder or Hub id (default: smollm2)")
    gen.add_argument("--recipe", default="h2o", help="recipe file or built-in name (default: h2o)")
    gen.add_argument("--budget", help="override the recipe's budget: a ratio (0.2) or tokens (512)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", help="a file holding the prompt")
    gen.add_argument("--max-new-tokens", type=count(1), default=128, help="tokens to generate (default: 128)")
    gen.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    add_device_arguments(gen)
    gen.add_argument("--compile", action="store_true",
                     help="decode through one compiled model step (torch.compile, fullgraph) once the cache is full; "
                          "pays a compile first: for GPUs and long generations")
    gen.set_defaults(func=cmd_generate)

    val = sub.add_parser("validate", help="check a recipe and print its plan per layer and head")
    val.add_argument("file", help="recipe file or built-in name")
    val.add_argument("--model", help="local Hugging Face folder whose shape to validate against (default: SmolLM2-135M)")
    val.add_argument("--layers", type=count(1, 1024), help="number of decoder layers")
    val.add_argument("--kv-heads", type=count(1, 1024), help="number of KV heads per layer")
    val.set_defaults(func=cmd_validate)

    prof = sub.add_parser("profile", help="FastGen: profile each head's pattern on a prompt, write a recipe")
    prof.add_argument("--model", default="smollm2", help="model alias, local Hugging Face folder or Hub id (default: smollm2)")
    source = prof.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the profiling prompt text")
    source.add_argument("--prompt-file", help="a file holding the profiling prompt")
    prof.add_argument("--out", type=Path, required=True, help="the recipe file to write (YAML)")
    prof.add_argument("--name", help="the recipe's name (default: the --out file name without .yaml)")
    prof.add_argument("--threshold", type=float, help="recovery threshold T in (0, 1] (default: 0.95)")
    prof.add_argument("--local-ratio", type=float, help="r_l, the local window's share of the length (default: 0.3)")
    prof.add_argument("--frequency-ratio", type=float, help="r_f, the frequent tokens' share of the length (default: 0.3)")
    prof.add_argument("--recovery", choices=["mass", "l1"], help="how recovery is measured (default: mass)")
    prof.add_argument("--gqa", choices=["min", "mean"], help="how a KV head's query heads combine (default: min)")
    prof.add_argument("--sinks", type=count(0), help="count the first N tokens as special tokens (default: 0)")
    prof.add_argument("--candidates", nargs="+", metavar="PATTERN",
                      help="patterns to try, e.g. special special+punct ... full (default: the paper's five)")
    prof.add_argument("--tokens", type=count(1), help="profile only the first N tokens of the prompt")
    prof.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    prof.add_argument("--threads", type=THREADS, help="torch threads (default: torch's choice)")
    add_device_arguments(prof)
    prof.set_defaults(func=cmd_profile)

    sub.add_parser("policies", help="list the registered policies").set_defaults(func=cmd_policies)
    sub.add_parser("recipes", help="list the built-in recipes").set_defaults(func=cmd_recipes)

    cmp = sub.add_parser("compare", help="sweep recipes x budgets and compare quality, memory and speed")
    add_compare_arguments(cmp)
    cmp.set_defaults(func=cmd_compare)

    bench = sub.add_parser("bench", help="throughput under a KV memory cap, or memory over a long stream")
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    bound_numbers(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.func(args)
    except KVPolicyError as error:
        print(f"kvpolicy: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvpolicy: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvpolicy ... | head`: the reader left; stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return 0


if __name__ == "__main__":
    sys.exit(main())
