"""`inferd bench serve` (load a server, report, save, plot) and `inferd bench compare`."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from pathlib import Path

from inferd.errors import InferdError

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_serve(sub)
    _add_compare(sub)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="load a running server and report TTFT, ITL, throughput, goodput, cost")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)")
    g.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="LoRA adapters the server serves: each request asks for the next in turn (the tokenizer is --model's)",
    )
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (env OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take in all")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true so outputs have fixed length')
    g.add_argument(
        "--eos-logit-bias",
        default=None,
        help="comma-separated eos token ids to bias by -100 (fixed lengths on servers without ignore_eos, "
        "e.g. llama-cpp-python: 1,106 for Gemma 3)",
    )
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    d = p.add_argument_group("dataset")
    d.add_argument(
        "--dataset", choices=["random", "quote", "shared-prefix", "sharegpt", "json-schema"], default="random"
    )
    d.add_argument(
        "--dataset-path",
        default=None,
        help="ShareGPT-format JSON file (--dataset sharegpt); for json-schema, a list of {name, schema} "
        "(default: the 143 real schemas shipped in inferd/bench/schemas)",
    )
    d.add_argument(
        "--structured-output-ratio",
        type=float,
        default=1.0,
        help="json-schema: the share of requests that send their schema as response_format (the rest only "
        "ask for it in the prompt); outputs are checked against it either way (schema_valid_rate)",
    )
    d.add_argument("--max-schema-chars", type=int, default=1500, help="json-schema: leave out longer schemas")
    d.add_argument(
        "--prompt-salt",
        default="",
        help="json-schema: text in each prompt's leading tag, so two runs of one seed (constrained and free) "
        "send the same schemas but share no prefix-cache entries",
    )
    d.add_argument(
        "--num-prompts", type=int, default=None, help="requests per level (default 1000; shared-prefix: N x M)"
    )
    d.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (shared-prefix: suffix tokens)")
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)")
    d.add_argument("--prefix-len", type=int, default=256)
    d.add_argument("--num-prefixes", type=int, default=4)
    d.add_argument("--suffixes-per-prefix", type=int, default=8)
    d.add_argument("--sharegpt-output-len", type=int, default=None, help="max_tokens instead of the reply's length")
    d.add_argument("--tokenizer", default=None, help="local tokenizer folder, used when the server has no /tokenize")
    d.add_argument("--tokenizer-source", choices=["auto", "server", "local"], default="auto")
    d.add_argument("--seed", type=int, default=0)

    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf: all at once")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    lo.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    lo.add_argument("--num-warmups", type=int, default=1, help="uncounted requests sent first (also a probe)")
    lo.add_argument("--sweep", default=None, help="levels to run: concurrency:1,4,16 or rate:0.5,1,2")

    r = p.add_argument_group("report")
    r.add_argument("--slo", "--goodput", nargs="+", default=[], metavar="NAME:MS", help="ttft:MS tpot:MS e2el:MS")
    r.add_argument("--slo-attainment", type=float, default=0.9, help="share of requests a sweep level must keep")
    r.add_argument("--percentiles", default="90,95,99", help="percentiles to report (vLLM: --metric-percentiles)")
    r.add_argument("--price-per-hour", type=float, default=None, help="price of one replica per hour")
    r.add_argument("--replicas", type=int, default=1)
    r.add_argument("--save-result", action="store_true", help="write the result JSON")
    r.add_argument("--save-detailed", action="store_true", help="also per-request lists and a JSONL line each")
    r.add_argument("--result-dir", default=".", help="where JSON and plots go")
    r.add_argument("--result-filename", default=None, help="JSON file name (default: bench-<label>-<model>-<date>)")
    r.add_argument("--label", default=None, help="name of this run in results and comparisons")
    r.add_argument("--plot", action="store_true", help="write PNG plots to --result-dir")
    r.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.set_defaults(func=run_serve)


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="print saved results side by side with ratios to the first")
    p.add_argument("results", nargs="+", help="result JSON files from `inferd bench serve --save-result`")
    p.add_argument("--save", default=None, help="write the ratios as JSON here")
    p.set_defaults(func=run_compare)


def _parse_percentiles(spec: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise InferdError(f"--percentiles {spec!r}: expected numbers like 90,95,99") from None
    if not ps or any(not 0 < x < 100 for x in ps):
        raise InferdError("--percentiles must be between 0 and 100")
    return ps


def _parse_json_object(spec: str | None) -> dict:
    if not spec:
        return {}
    try:
        obj = json.loads(spec)
    except ValueError as e:
        raise InferdError(f"--extra-body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InferdError("--extra-body must be a JSON object")
    return obj


def _parse_ids(spec: str | None) -> tuple[int, ...]:
    if not spec:
        return ()
    try:
        return tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise InferdError(f"--eos-logit-bias {spec!r}: expected token ids like 1,106") from None


def _validate(args: argparse.Namespace) -> None:
    if args.num_prompts is not None and args.num_prompts < 1:
        raise InferdError("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise InferdError("--max-concurrency must be >= 1")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise InferdError("--request-rate and --burstiness must be > 0")
    if args.num_warmups < 0 or args.replicas < 1:
        raise InferdError("--num-warmups must be >= 0 and --replicas >= 1")
    if not 0 < args.slo_attainment <= 1:
        raise InferdError("--slo-attainment must be in (0, 1]")
    if args.dataset == "sharegpt" and not args.dataset_path:
        raise InferdError("--dataset sharegpt needs --dataset-path FILE.json")


def _make_dataset(args, tok):
    from inferd.bench.datasets import (
        JsonSchemaDataset,
        QuoteDataset,
        RandomDataset,
        SharedPrefixDataset,
        ShareGPTDataset,
    )

    if args.dataset == "json-schema":
        return JsonSchemaDataset(
            tok,
            args.random_output_len,
            args.structured_output_ratio,
            args.seed,
            args.max_schema_chars,
            args.dataset_path,
            args.prompt_salt,
        )

    if args.dataset == "quote":
        return QuoteDataset(tok, args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed)
    if args.dataset == "random":
        return RandomDataset(tok, args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed)
    if args.dataset == "shared-prefix":
        return SharedPrefixDataset(
            tok,
            args.prefix_len,
            args.num_prefixes,
            args.suffixes_per_prefix,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    return ShareGPTDataset(args.dataset_path, tok, args.seed, args.sharegpt_output_len)


def _default_model(server) -> str:
    ids = [m.get("id") for m in server.models if isinstance(m, dict) and m.get("id")]
    if not ids:
        raise InferdError("the server lists no models at /v1/models; pass --model")
    return ids[0]


def run_serve(args: argparse.Namespace) -> int:
    from inferd.bench import results as res
    from inferd.bench.client import ClientConfig, Endpoint, normalize_base_url
    from inferd.bench.metrics import parse_slos
    from inferd.bench.report import print_result
    from inferd.bench.runner import BenchConfig, Sweep, preflight, run_benchmark
    from inferd.bench.tokenizers import resolve_tokenizer

    _validate(args)
    try:
        slos = parse_slos(args.slo)
    except ValueError as e:
        raise InferdError(str(e)) from None
    sweep = Sweep.parse(args.sweep) if args.sweep else None
    base_url = normalize_base_url(args.base_url)
    server = preflight(base_url, args.api_key)
    model = args.model or _default_model(server)
    served = [m.get("id") for m in server.models if isinstance(m, dict)]
    unknown = bool(served) and model not in served  # llama.cpp answers any name, so this is a hint, not an error
    if unknown:
        logger.warning("the server lists %s, not %r; requests may fail with 404", served, model)
    try:
        tok = resolve_tokenizer(args.tokenizer_source, base_url, model, args.tokenizer, args.api_key)
    except InferdError as e:
        hint = f" (the server serves {served}, not {model!r}: check --model)" if unknown else ""
        raise InferdError(f"{e}{hint}") from None
    dataset = _make_dataset(args, tok)
    if args.lora_modules:
        from inferd.bench.datasets import ModelMix

        dataset = ModelMix(dataset, list(args.lora_modules))
    client = ClientConfig(
        base_url=base_url,
        model=model,
        endpoint=Endpoint(args.endpoint),
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        eos_logit_bias=_parse_ids(args.eos_logit_bias),
        temperature=args.temperature,
        extra_body=_parse_json_object(args.extra_body),
        timeout_s=args.request_timeout,
    )
    cfg = BenchConfig(
        client=client,
        num_prompts=args.num_prompts or dataset.default_count,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        sweep=sweep,
        seed=args.seed,
        slos=slos,
        slo_attainment=args.slo_attainment,
        percentiles=_parse_percentiles(args.percentiles),
        price_per_hour=args.price_per_hour,
        replicas=args.replicas,
        show_progress=not args.no_progress,
    )
    results = run_benchmark(cfg, dataset, tok, server)
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    settings["dataset_default_count"] = dataset.default_count
    result = res.build_result(cfg, settings, server, tok.name, results, args.save_detailed)
    print_result(result)
    _save(args, result, results, model)
    return 0 if any(r.summary["completed"] for r in results) else 1


def _save(args, result: dict, results, model: str) -> None:
    from inferd.bench import results as res

    out_dir = Path(args.result_dir)
    stem = Path(args.result_filename).stem if args.result_filename else res.default_stem(model, args.label)
    if args.save_result or args.save_detailed:
        path = res.save_json(result, out_dir / f"{stem}.json")
        print(f"result saved to {path}")
    if args.save_detailed:
        print(f"per-request lines saved to {res.save_request_lines(results, out_dir / f'{stem}.requests.jsonl')}")
    if args.plot:
        from inferd.bench.plots import write_plots

        for path in write_plots(results, result, out_dir, stem):
            print(f"plot saved to {path}")


def run_compare(args: argparse.Namespace) -> int:
    from inferd.bench.compare import compare

    out = compare(args.results)
    if args.save:
        Path(args.save).write_text(json.dumps(out, indent=2))
    return 0
