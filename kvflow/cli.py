"""`kvflow` command line. Engine and server flags are generated from the config dataclasses' fields
(kvflow/arg_utils.py), so names, choices, defaults and help text live in one place (kvflow/config.py).
Boolean flags come in pairs, `--flag / --no-flag`, as in vLLM."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from kvflow.arg_utils import FlagParser, add_dataclass_args, dataclass_kwargs, literal_choices
from kvflow.config import (
    API_KEY_ENV,
    DType,
    EngineConfig,
    ModelConfig,
    QuantConfig,
    QuantizedKVDType,
    QuantMethod,
    ScoringPath,
    ServerConfig,
)
from kvflow.errors import KVFlowError
from kvflow.sampling_params import SamplingParams
from kvflow.stats import RequestTimeline

# ServerConfig fields that are flags of the top-level parser, not of `serve`: they apply to every command.
GLOBAL_SERVER_FIELDS = ("log_level",)


def _engine_exclude(section: type) -> tuple[str, ...]:
    """The model is the positional MODEL (demo: --model), not a generated flag."""
    return ("model",) if section is ModelConfig else ()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine field, in one help group per config section."""
    for section in EngineConfig.section_types():
        group = parser.add_argument_group(section.__name__)
        add_dataclass_args(group, section, exclude=_engine_exclude(section))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for section in EngineConfig.section_types():
        kwargs.update(dataclass_kwargs(args, section, exclude=_engine_exclude(section)))
    return kwargs


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    # Not SamplingParams' defaults on purpose: the API's are OpenAI's (16 tokens, temperature 1), a
    # command-line try-out wants a longer, greedy completion.
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1: off")
    group.add_argument("--top-k", type=int, default=0, help="0: off")
    group.add_argument("--min-p", type=float, default=0.0, help="0: off")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens even past EOS")


def _model_dir(args: argparse.Namespace) -> str:
    """The MODEL argument, or the bundled target model when it is omitted."""
    if args.model:
        return str(args.model)
    from kvflow.assets import bundled_model_dir

    return str(bundled_model_dir("target"))


def _run_as_tensor_parallel_worker(model: str, kwargs: dict[str, Any]) -> int | None:
    """Under torchrun, every rank but 0 runs as a tensor-parallel worker (README, "Tensor parallel");
    None: this process is the engine."""
    if kwargs.get("tensor_parallel_size", 1) == 1 or os.environ.get("RANK", "0") == "0":
        return None
    from kvflow.parallel.executor import run_torchrun_worker

    return run_torchrun_worker(EngineConfig.from_kwargs(model=model, **kwargs))


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvflow.engine.engine import LLMEngine

    if (status := _run_as_tensor_parallel_worker(_model_dir(args), engine_kwargs(args))) is not None:
        return status
    engine = LLMEngine.from_kwargs(model=_model_dir(args), **engine_kwargs(args))
    prompt: str | list[int] = args.prompt
    if args.chat:  # the rendered template carries its special tokens (BOS for Llama-3): add none
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    rid = engine.add_request(None, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
                final = out if out.finished else final
    sys.stdout.write("\n")
    if final is not None:
        print(timing_summary(final.metrics, final.outputs[0].finish_reason), file=sys.stderr)
    spec = engine.spec_stats
    if spec.num_drafts:
        print(
            f"[kvflow] speculation: {spec.num_accepted_tokens}/{spec.num_draft_tokens} drafts accepted "
            f"({spec.acceptance_rate:.0%}), {spec.mean_accepted_length:.2f} tokens per verification step, "
            f"per position {spec.accepted_per_pos}; estimated speedup "
            f"{engine.spec_controller.speedup(1) or float('nan'):.2f}x",
            file=sys.stderr,
        )
    return 0


def timing_summary(t: RequestTimeline, finish_reason: str | None) -> str:
    n = len(t.token_times)
    ttft = (t.ttft or 0.0) * 1e3
    itl = (t.tpot or 0.0) * 1e3
    rate = (n - 1) / t.decode_time if n > 1 and t.decode_time else 0.0
    return (
        f"[kvflow] TTFT {ttft:.1f} ms | ITL {itl:.1f} ms/token | {rate:.1f} tokens/s decode | "
        f"{n} tokens | cached prompt tokens {t.num_cached_prompt_tokens} | finish {finish_reason}"
    )


DEMO_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(root):\n",
    'class Stack:\n    """A last-in, first-out container."""\n\n    def __init__(self):\n',
    "The with statement is used to",
)


def _cmd_demo(args: argparse.Namespace) -> int:
    """Generate from a few prompts, one at a time then all together, with each request's timing."""
    from kvflow.llm import LLM

    model = _model_dir(args)
    print(f"[kvflow demo] model: {model}", file=sys.stderr)
    llm = LLM(model, **engine_kwargs(args))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for prompt in DEMO_PROMPTS:
        out = llm.generate([prompt], params)[0]
        print(f"--- prompt ---\n{prompt}\n--- completion ---\n{out.outputs[0].text}")
        print(timing_summary(out.metrics, out.outputs[0].finish_reason), file=sys.stderr)
    outs = llm.generate(list(DEMO_PROMPTS), params)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    start = min(o.metrics.arrival_time for o in outs)
    end = max(o.metrics.token_times[-1] for o in outs if o.metrics.token_times)
    print(
        f"[kvflow demo] {len(outs)} prompts batched: {n} tokens in {end - start:.2f} s "
        f"= {n / (end - start):.1f} tokens/s (continuous batching)",
        file=sys.stderr,
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvflow.kv_transfer.nixl_transport import exit_now, nixl_agent_made
    from kvflow.server.launcher import run_server

    server = dataclass_kwargs(args, ServerConfig)  # log_level included: the top-level flag sets it
    server["api_key"] = args.api_key or os.environ.get(API_KEY_ENV) or None
    if (status := _run_as_tensor_parallel_worker(_model_dir(args), engine_kwargs(args))) is not None:
        return status
    config = ServerConfig(**server)
    # The dashboard's doctor view: the doctor sits above the server, so it is passed in from here.
    live_doctor = None
    if config.dashboard:
        from kvflow.doctor.live import LiveDiagnosis

        live_doctor = LiveDiagnosis()
    status = run_server(_model_dir(args), config, engine_kwargs(args), live_doctor)
    if nixl_agent_made():  # nixl-cu12 crashes a process that made an agent at exit: end it here, done
        exit_now(status)
    return status


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with streaming and /metrics")
    serve.add_argument("model", nargs="?", help="checkpoint directory (default: the bundled model)")
    group = serve.add_argument_group(ServerConfig.__name__)
    add_dataclass_args(group, ServerConfig, exclude=GLOBAL_SERVER_FIELDS)
    add_engine_args(serve)
    serve.set_defaults(func=_cmd_serve)


def _cmd_quant_eval(args: argparse.Namespace) -> int:
    import json
    import textwrap

    from kvflow.llm import LLM
    from kvflow.quality.quant_eval import compare

    model = _model_dir(args)
    text = Path(args.text).read_text() if args.text else Path(textwrap.__file__).read_text()
    common = {"dtype": args.dtype, "max_model_len": args.window + 1, "kv_cache_dtype": args.kv_cache_dtype}
    reference = LLM(model, dtype=args.dtype, max_model_len=args.window + 1)
    ids = reference.get_tokenizer().encode(text)[: args.max_tokens]
    if args.candidate:  # other checkpoints of the same model: GGUF files of several types, FP8, GPTQ ...
        candidates = [(Path(c).name, LLM(c, **common)) for c in args.candidate]
    else:
        quantized = {
            "quantization": args.quantization,
            "quantization_group_size": args.quantization_group_size,
            "quantize_lm_head": args.quantize_lm_head,
        }
        candidates = [(args.quantization, LLM(model, **common, **quantized))]
    reports = [
        compare(reference, llm, ids, args.window, args.kv_cache_dtype, args.path, label)
        for label, llm in candidates
    ]
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=1))
        return 0
    what = (
        ", ".join(label for label, _ in candidates)
        if args.candidate
        else f"{args.quantization} weights (group {args.quantization_group_size}, LM head "
        f"{'quantized' if args.quantize_lm_head else 'kept'})"
    )
    print(
        f"quant-eval {model}: {what}, {args.kv_cache_dtype} KV vs {args.dtype}, {reports[0]['positions']} "
        f"positions scored on the {args.path} path"
    )
    for report in reports:
        ref, cand = report["paths"]
        print(
            f"  {cand['label']}: mean KL {report['mean_kl']:.5f} nats, "
            f"top-1 agreement {report['top1_agreement']:.2%}"
        )
        for p in (cand,) if report is not reports[0] else (ref, cand):
            print(
                f"    {p['label']:<24} perplexity {p['perplexity']:.3f}, "
                f"decode {p['decode_tokens_per_s']:.1f} tok/s, weights {p['weight_bytes'] / 2**20:.1f} MiB"
            )
    return 0


def _cmd_profile_steps(args: argparse.Namespace) -> int:
    """Measure the engine's step time over prompt lengths and decode batch sizes, as JSON (the
    doctor's simulator reads it: kvflow/doctor/step_profile.py)."""
    import json

    from kvflow.engine.engine import LLMEngine
    from kvflow.engine.step_profile import profile_steps

    engine = LLMEngine.from_kwargs(model=_model_dir(args), **engine_kwargs(args))
    print(json.dumps(profile_steps(engine, repeats=args.repeats)))
    return 0


def _cmd_build_kernels(args: argparse.Namespace) -> int:
    """Build (or find) the native CPU kernels now, so that a server's first request is not the build."""
    from kvflow.kernels import native_build

    build = native_build()
    if build.module is not None:
        print(f"[kvflow] native CPU kernels ready: {build.build_dir}", file=sys.stderr)
        return 0
    print(
        f"[kvflow] native CPU kernels unavailable ({build.reason}): kvflow uses its torch paths",
        file=sys.stderr,
    )
    return 1 if build.build_dir is not None else 0  # a failed build is an error; an unsuited CPU is not


def _add_quant_eval_parser(sub: Any) -> None:
    qe = sub.add_parser(
        "quant-eval", help="quality and speed of quantized weights against the unquantized model"
    )
    qe.add_argument("model", nargs="?", help="checkpoint directory (default: the bundled model)")
    qe.add_argument(
        "--candidate",
        action="append",
        default=None,
        help="a checkpoint directory or GGUF file of the same model to score against MODEL instead of "
        "quantizing MODEL at load (repeat it to compare several, e.g. a model's Q8_0, Q4_K_M and Q4_0 "
        "GGUF files against its bf16 checkpoint)",
    )
    # quant-eval measures a quantized path against bfloat16, so its defaults are not the engine's
    # (no quantization, the checkpoint's dtype); the choices are the engine's Literal types.
    qe.add_argument(
        "--quantization", choices=literal_choices(QuantMethod), default="int8", help="the candidate's weights"
    )
    qe.add_argument(
        "--kv-cache-dtype",
        choices=("auto", *literal_choices(QuantizedKVDType)),
        default="auto",
        help="the candidate's KV storage (auto: the model dtype, unquantized)",
    )
    add_dataclass_args(qe, QuantConfig, include=("quantization_group_size", "quantize_lm_head"))
    qe.add_argument("--dtype", choices=literal_choices(DType), default="bfloat16", help="both paths' dtype")
    qe.add_argument("--text", default=None, help="text file to score (default: the stdlib's textwrap.py)")
    qe.add_argument("--window", type=int, default=512, help="tokens of context per scored window")
    qe.add_argument(
        "--path",
        choices=literal_choices(ScoringPath),
        default="prefill",
        help="score positions as one prefill chunk per window, or as decode rows (the kernels that "
        "generate tokens; slower)",
    )
    qe.add_argument("--max-tokens", type=int, default=4096, help="score at most this many tokens")
    qe.add_argument("--json", action="store_true", help="print the report as JSON")
    qe.set_defaults(func=_cmd_quant_eval)


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="kvflow", description=__doc__)
    add_dataclass_args(parser, ServerConfig, include=GLOBAL_SERVER_FIELDS)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed")
    gen.add_argument("model", nargs="?", help="checkpoint directory (default: the bundled model)")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)
    demo = sub.add_parser("demo", help="generate from a few prompts with timing (bundled model by default)")
    demo.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens per completion")
    add_engine_args(demo)
    demo.set_defaults(func=_cmd_demo)
    _add_serve_parser(sub)
    kernels = sub.add_parser(
        "build-kernels",
        help="build the native CPU kernels now (otherwise the first model load does, for a few minutes)",
    )
    kernels.set_defaults(func=_cmd_build_kernels)
    profile = sub.add_parser(
        "profile-steps",
        help="measure the engine's step time over prompt lengths and decode batch sizes (JSON; the "
        "doctor's simulator reads it)",
    )
    profile.add_argument("model", nargs="?", help="checkpoint directory (default: the bundled model)")
    profile.add_argument("--repeats", type=int, default=3, help="probes per prompt length (medians)")
    add_engine_args(profile)
    profile.set_defaults(func=_cmd_profile_steps)
    from kvflow.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from kvflow.doctor.cli import add_doctor_parser

    add_doctor_parser(sub)
    _add_quant_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (KVFlowError, ValueError) as e:  # bad input (flags, paths, workloads): a message, not a trace
        print(f"kvflow: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
