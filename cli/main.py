"""The `cellserve` command: serve, chat, bench, build-kernels."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from server.backend import BackendFactory
from server.settings import Settings

# flag -> Settings field; booleans use --x/--no-x
_FLAGS: list[tuple[str, type | None, str]] = [
    (
        "model",
        str,
        "GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M); NAME=PATH, "
        "repeatable: one of several models, as with --models-dir",
    ),
    (
        "models_dir",
        str,
        "serve every GGUF file and model folder in this folder, each named by its file (without "
        ".gguf) or folder: a request's `model` picks one, loaded on first use (llama.cpp's "
        "router mode; GET /models, POST /models/load, POST /models/unload)",
    ),
    (
        "models_max",
        int,
        "with several models: most loaded at once, each with its own --n-cells KV cache; the "
        "least recently used idle one is unloaded to load another (default 4)",
    ),
    (
        "models_autoload",
        None,
        "with several models: a request loads the model it names (default); off: only "
        "POST /models/load does, and requests for a model not loaded get 400",
    ),
    ("chat_template", str, "Jinja chat template (file or string) replacing the model's own"),
    ("host", str, "bind address (default 127.0.0.1)"),
    ("port", int, "port (default 8000)"),
    ("n_cells", int, "KV cache size in cells (tokens), shared by all sequences"),
    ("n_seq_max", int, "sequence ids (running requests + prefix-cache holders)"),
    ("n_batch", int, "tokens per engine step"),
    ("ctx_per_seq", int, "context length of one sequence"),
    ("context_shift", None, "shift the context instead of stopping at the limit"),
    ("prefix_cache", None, "keep finished prompts in the cache for reuse"),
    (
        "prefix_index",
        None,
        "remember finished conversations past the n_seq_max holders in a radix index over "
        "cells (default on; off: only the holders)",
    ),
    (
        "swa_index_cells",
        int,
        "models with sliding-window layers (Gemma 2/3, gpt-oss): cells each window pool gets for "
        "the prefix index, which keeps a conversation's last window-size positions there "
        "(default: n_cells / 4; 0: only the n_seq_max holders are remembered)",
    ),
    (
        "state_checkpoints",
        int,
        "recurrent and hybrid models (Mamba2, Granite 4.0-H): state slots kept as prefix-cache "
        "checkpoints beside one slot per sequence id; each costs one whole state "
        "(default: n_seq_max; 0: only finished sequences' final states are reused)",
    ),
    (
        "state_checkpoint_interval",
        int,
        "recurrent and hybrid models: a prompt also keeps its state every this many tokens, "
        "so that prompts sharing a system prompt reuse it (default 256)",
    ),
    (
        "dtype",
        str,
        "float32 | bfloat16 | float16 (default on CPU: bfloat16 where the CPU computes it "
        "natively (AVX-512 BF16, AMX), else float32)",
    ),
    (
        "spec_type",
        str,
        "speculative decoding: none (default) | ngram (prompt lookup: the continuation of the "
        "latest earlier occurrence of the last tokens) | draft (a draft model's greedy tokens, "
        "the default with --model-draft) | ngram,draft (both: the lookup first, the draft "
        "model where it finds nothing; ngram with --model-draft means this); llama.cpp's "
        "ngram-simple / draft-simple too. Lossless: the same tokens as without it",
    ),
    (
        "model_draft",
        str,
        "speculative decoding's draft model: a GGUF file or HF folder with the target's "
        "tokenizer (e.g. a 0.5B for a 1.5B), loaded like the target with its own KV cache",
    ),
    ("draft_max", int, "speculative decoding: tokens drafted per sequence and step (default 16)"),
    ("draft_min", int, "speculative decoding: shorter proposals are not verified (default 0)"),
    (
        "draft_vocab",
        int,
        "speculative decoding: the draft's head scores ids below it and the sequences' (0: all)",
    ),
    (
        "cache_type_k",
        str,
        "how K rows are stored: f32 | f16 | bf16 | q8_0 | q4_0 (llama.cpp's names; q8_0 and "
        "q4_0: blocks of 32 with an fp16 scale, about 1/2 and 1/4 of f16's bytes; default: "
        "bf16 where the CPU has AVX-512 BF16, else f16)",
    ),
    ("cache_type_v", str, "how V rows are stored: as --cache-type-k (default: the same rule)"),
    ("device", str, "cpu | cuda | auto"),
    (
        "quant",
        str,
        "gguf | int8 | int4 | none: weight format on CPU (default for a quantized GGUF: gguf, "
        "its own blocks memory-mapped, where the C++ kernels are built; else int4 for 4-bit "
        "types and int8 for 5-8-bit ones, re-quantized, which CHANGES the outputs slightly, "
        "see the README; --quant none --dtype float32 is the reference)",
    ),
    ("threads", int, "torch CPU threads for model steps (default: every core)"),
    ("api_key", str, "require 'Authorization: Bearer <key>'"),
    ("served_model_name", str, "model id in the API (default: the file name)"),
    (
        "kv_events_block_size",
        int,
        "positions per virtual KV block that routers see (vllm:cache_config_info block_size; "
        "set it to the router's block size, e.g. llm-d's 64; default 16)",
    ),
    (
        "kv_events_endpoint",
        str,
        "publish vLLM-style KV events on this ZMQ PUB address: one with '*' (tcp://*:5557), "
        "'::', ipc:// or inproc:// is bound, any other is connected to (as vLLM does)",
    ),
    (
        "kv_events_topic",
        str,
        "ZMQ topic of the KV events (default kv@<host>:<port>@<model>; empty with "
        "--kv-events-encoding map, as vllm-router expects)",
    ),
    (
        "kv_events_replay_endpoint",
        str,
        "ZMQ ROUTER address (bound) where a late subscriber asks for past event batches",
    ),
    (
        "kv_events_encoding",
        str,
        "array (vLLM's array-like structs, llm-d reads them; default) | map (tagged-map "
        "events in the positional batch, vllm-router's wire format)",
    ),
    (
        "kv_events_config",
        str,
        "vLLM's --kv-events-config JSON (endpoint, replay_endpoint, topic, buffer_steps, hwm, "
        "max_queue_size); the --kv-events-* flags override it",
    ),
    (
        "slot_save_path",
        str,
        "folder for llama.cpp's POST /slots/{id}?action=save|restore (a slot is a seq id; "
        "what it holds is a finished conversation's cached cells); without it save and "
        "restore answer 501",
    ),
    (
        "cache_ram",
        int,
        "MiB of host RAM for a second prefix-cache tier: finished prompts are copied there and "
        "come back on a prefix match after the live cache evicted them (default 0: off)",
    ),
    (
        "cache_dir",
        str,
        "folder for a disk tier of the prefix cache that survives restarts: finished prompts "
        "are written there and a restarted server reuses them (same model file only)",
    ),
    ("cache_dir_max_mib", int, "largest size of --cache-dir's files in MiB (default 10240)"),
    (
        "cache_tier_min_tokens",
        int,
        "shortest finished prompt copied to --cache-ram / --cache-dir (default 64)",
    ),
    ("max_queue", int, "waiting requests before 429"),
    ("max_tokens_limit", int, "largest max_tokens a request may ask for"),
    ("max_n", int, "largest n a request may ask for"),
    ("max_body_bytes", int, "largest request body"),
    ("request_timeout", float, "seconds before a request is aborted"),
    ("stream_buffer", int, "unsent tokens a stream may hold before a slow reader is cut off"),
    ("batch_invariant", None, "logits independent of the rest of the batch (slower at batch < 16)"),
    ("drain_timeout", float, "seconds running requests get to finish on SIGTERM"),
    (
        "drain_grace",
        float,
        "seconds after SIGTERM during which /health answers 503 but new requests are still "
        "served, so a router polling /health moves traffic away before admission stops (default 0)",
    ),
    ("protect_metrics", None, "require the API key on /metrics too"),
    ("log_level", str, "critical | error | warning | info | debug"),
    ("log_prompts", None, "log prompts (off: prompts are never logged)"),
    (
        "cors_allow_origins",
        str,
        "comma-separated origins allowed to call the API from a browser, or '*' "
        "(default: none, no CORS headers)",
    ),
]


# llama.cpp's spellings of the same flags
_ALIASES = {
    "model_draft": ("-md",),
    "draft_max": ("--spec-draft-n-max",),
    "draft_min": ("--spec-draft-n-min",),
    "cache_type_k": ("-ctk",),
    "cache_type_v": ("-ctv",),
}


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API")
    for name, kind, help_text in _FLAGS:
        flags = ("--" + name.replace("_", "-"), *_ALIASES.get(name, ()))
        if kind is None:
            p.add_argument(
                *flags,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif name == "model":  # repeatable: several models (server/model_router.py)
            p.add_argument(*flags, dest=name, action="append", default=None, help=help_text)
        else:
            p.add_argument(*flags, dest=name, type=kind, default=None, help=help_text)
    _lora_flags(p)


def build_settings(args: argparse.Namespace) -> Settings:
    """CELLSERVE_* environment variables, overridden by the flags given on the command line."""
    given = {name: getattr(args, name) for name, _, _ in _FLAGS if getattr(args, name) is not None}
    models = given.pop("model", [])
    if len(models) == 1 and ("=" not in models[0] or Path(models[0]).exists()):
        given["model"] = models[0]
    elif models:
        given["models"] = models
    if args.lora:
        given["lora"] = args.lora
    if args.lora_scaled:
        given["lora_scaled"] = [tuple(pair) for pair in args.lora_scaled]  # pydantic: floats
    if args.lora_init_without_apply:
        given["lora_init_without_apply"] = True
    if args.allow_runtime_lora:
        given["allow_runtime_lora"] = True
    return Settings(**given)


def _lora_flags(p: argparse.ArgumentParser) -> None:
    """llama.cpp's LoRA flags (server/lora.py); PATH may be NAME=PATH (vLLM's --lora-modules)."""
    p.add_argument(
        "--lora",
        action="append",
        metavar="PATH",
        help="a LoRA adapter (PEFT folder or GGUF LoRA) at global scale 1; repeatable; "
        "NAME=PATH names it (default: the folder or file name); requests pick it by model "
        "name or by id in `lora`",
    )
    p.add_argument(
        "--lora-scaled",
        action="append",
        nargs=2,
        metavar=("PATH", "SCALE"),
        help="a LoRA adapter at its own global scale; repeatable (ids follow the --lora ones)",
    )
    p.add_argument(
        "--lora-init-without-apply",
        action="store_true",
        default=None,
        help="load the adapters with global scale 0: only requests that ask for one use it",
    )
    p.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        default=None,
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; also "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
    )


def serve(args: argparse.Namespace, backend_factory: BackendFactory | None = None) -> int:
    from pydantic import ValidationError

    from server.run import run_server

    try:
        settings = build_settings(args)
    except ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            flag = f"--{where.replace('_', '-')}: " if where else ""  # "": a whole-settings check
            msg = err["msg"].removeprefix("Value error, ")
            print(f"cellserve serve: {flag}{msg}", file=sys.stderr)
        return 2
    if settings.router_mode:
        from server.models_dir import model_sources

        try:
            model_sources(settings)
        except ValueError as exc:
            print(f"cellserve serve: {exc}", file=sys.stderr)
            return 2
    return run_server(settings, backend_factory)


def build_kernels(args: argparse.Namespace) -> int:
    """Compile the C++ kernels ahead of time: every ISA level this CPU runs (or --all x86
    levels, for an image that runs on other CPUs); `cellserve serve` never compiles them."""
    from model import kernels
    from model.kernels import isa

    d = isa.describe()
    forced = f", {isa.ENV}={d['forced']}" if d["forced"] else ""
    print(f"cellserve build-kernels: CPU {d['cpu']}: {d['detected']}{forced}", flush=True)
    levels = args.level or (kernels.all_levels() if args.all else kernels.levels_for_this_cpu())
    print(f"  building {', '.join(levels)} into {kernels.kernel_dir()}", flush=True)
    failed = 0
    for r in kernels.build_kernels(levels, verbose=args.verbose, force=args.force):
        if r.error is not None:
            failed += 1
            print(f"  {r.level}: FAILED: {r.error.strip().splitlines()[-1]}", file=sys.stderr)
        else:
            print(f"  {r.level}: {'up to date' if r.reused else 'built'} {r.path}", flush=True)
    if args.prune:
        for path in kernels.remove_stale():
            print(f"  removed the stale build {path.name}")
    print(f"  `cellserve serve` here will use: {kernels.choose().reason}")
    return 1 if failed else 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cellserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    chat = sub.add_parser("chat", help="chat with a running server in the terminal")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--api-key", default=None)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--model", default=None)
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    sub.add_parser("bench", help="benchmarks (see `cellserve bench --help`)", add_help=False)
    build = sub.add_parser(
        "build-kernels", help="compile the C++ CPU kernels (make install runs it)"
    )
    build.add_argument(
        "--all",
        action="store_true",
        help="every ISA level of this architecture, not only "
        "those this CPU runs (a Docker image for other machines)",
    )
    build.add_argument(
        "--level",
        action="append",
        choices=("generic", "avx2", "avx512", "avx512_bf16"),
        help="only this level (repeatable)",
    )
    build.add_argument("--force", action="store_true", help="rebuild levels already built")
    build.add_argument("--prune", action="store_true", help="delete stale builds")
    build.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    return parser


def main(argv: list[str] | None = None, backend_factory: BackendFactory | None = None) -> int:
    """`backend_factory` replaces the model load (tests inject fakes or fault hooks here)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        try:
            from bench.cli import main as bench_main
        except ImportError as exc:
            print(f"cellserve bench is not available: {exc}", file=sys.stderr)
            return 2
        return int(bench_main(argv[1:]) or 0)
    args = make_parser().parse_args(argv)
    if args.command in ("serve", "build-kernels"):
        from model.kernels import isa

        try:
            isa.apply_forced_isa()  # before torch's first op: CELLSERVE_ISA caps its libraries
        except ValueError as exc:
            print(f"cellserve {args.command}: {exc}", file=sys.stderr)
            return 2
    if args.command == "serve":
        return serve(args, backend_factory)
    if args.command == "build-kernels":
        return build_kernels(args)
    from cli.chat import run_chat

    return run_chat(args)


if __name__ == "__main__":
    sys.exit(main())
