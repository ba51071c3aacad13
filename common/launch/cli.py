"""The `pdserve` command: `prefill` / `decode` / `bootstrap` run one role, `generate` runs offline.

Each role runs as its own interpreter (`python -m prefill_node ...`), so this module never
imports a role package.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from common.config import ConfigError, ModelConfig
from common.flags import add_model_args
from common.launch.roles import ROLE_MODULES


def _cmd_generate(args: argparse.Namespace) -> int:
    from common.launch.offline import OfflineResult, generate_stream
    from common.model.loader import resolve_model_dir
    from common.model.runner import ModelRunner
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    cfg = ModelConfig.from_args(args)
    model_dir = resolve_model_dir(cfg.model_path)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    runner = ModelRunner.from_path(
        str(model_dir),
        dtype=cfg.resolved_dtype(),
        device=cfg.device,
        page_size=cfg.page_size,
        context_length=cfg.context_length,
        max_total_tokens=cfg.max_total_tokens or 8192,
        pack_weights=cfg.pack_weights,
        cpu_kernels=cfg.cpu_kernels,
        attention_backend=cfg.attention_backend,
        cuda_graph_max_bs=cfg.cuda_graph_max_bs,
        disable_cuda_graph=cfg.disable_cuda_graph,
        kernel_cache_dir=cfg.kernel_cache_dir or None,
    )
    prompt = " ".join(args.prompt)
    ids = (
        tokenizer.encode(prompt)
        if args.raw
        else tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    )
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    start = time.perf_counter()
    for item in generate_stream(runner, tokenizer, ids, params):
        if isinstance(item, OfflineResult):
            dt = time.perf_counter() - start
            print(
                f"\n[{len(item.token_ids)} tokens in {dt:.2f} s, finish_reason="
                f"{item.finish_reason.kind.value}]",
                file=sys.stderr,
            )
        else:
            print(item, end="", flush=True)
    return 0


def role_command(role: str, args: list[str]) -> list[str]:
    """The argv that runs one role as its own process."""
    return [sys.executable, "-m", ROLE_MODULES[role], *args]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode disaggregated LLM serving"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for role, module in ROLE_MODULES.items():
        sub.add_parser(role, help=f"run one {role} process (python -m {module}; see its --help)")
    sub.add_parser("launch", help="run bootstrap + prefill + decode processes on this machine")
    gen = sub.add_parser("generate", help="generate offline from one prompt with one model runner")
    add_model_args(gen)
    gen.add_argument("prompt", nargs="+", help="the user message (chat template applied)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ROLE_MODULES:
        # `pdserve prefill ...` is `python -m prefill_node ...` in this same process slot.
        cmd = role_command(argv[0], argv[1:])
        os.execv(cmd[0], cmd)
    if argv and argv[0] == "launch":
        from common.launch.launcher import main as launch_main

        return launch_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
