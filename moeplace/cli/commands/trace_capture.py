"""``place trace capture``: build a Hugging Face MoE model from its config.json (random weights, or local
weights with --weights), generate from a file of prompts, and write the routing trace it produced."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from moeplace.cli import flags
from moeplace.cli.commands import add_force, add_json, add_progress
from moeplace.foundation.files import Outputs
from moeplace.foundation.formats import tagged
from moeplace.traces.capture import CaptureConfig, run_capture
from moeplace.traces.format import TRACE_DIRECTORY

GROUP = "trace"


def register(sub) -> None:
    p = sub.add_parser(
        "capture", help="capture routing from a Hugging Face MoE model during generate()",
        description="Builds the model from --hf-config (random weights unless --weights names a local "
                    "checkpoint directory; nothing is downloaded), runs generate() over the prompts in "
                    "left-padded batches with forward hooks on every MoE router, and writes one trace row "
                    "per (token, MoE layer) with the top-k expert ids and gate weights the experts used. "
                    "Without a local tokenizer, prompts are encoded as UTF-8 bytes modulo vocab_size.")
    p.add_argument("--hf-config", required=True, type=Path, help="Hugging Face config.json of an MoE model "
                   "(deepseek_v3 / kimi_k2, qwen3_moe, qwen2_moe, mixtral, olmoe)")
    p.add_argument("--prompts", required=True, type=Path, help="text file, one prompt per non-blank line")
    p.add_argument("--max-new-tokens", required=True, type=flags.positive_int, help="tokens generated per prompt")
    p.add_argument("--out", required=True, type=Path, help="trace directory to write (atomically; an existing one "
                   "only replaced with --force, and only when it is a moeplace trace)")
    add_force(p)
    add_json(p, "what was written (path, kind) and the capture's figures")
    add_progress(p)
    p.add_argument("--batch-size", type=flags.positive_int, default=8, help="prompts per generate() batch (default 8)")
    p.add_argument("--weights", type=Path, help="local checkpoint directory (safetensors); default random")
    p.add_argument("--tokenizer", type=Path, help="local tokenizer directory (default: --weights if it has "
                   "one, else the byte-level stand-in)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--seed", type=flags.seed, default=0, help="seed of the random weights and of sampling")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--ignore-eos", action="store_true",
                   help="run every request for exactly --max-new-tokens (no stop token)")
    p.add_argument("--domain", help="domain tag written on every row")
    p.set_defaults(func=run)


def run(args) -> int:
    outs = Outputs(inputs=[args.hf_config, args.prompts, args.weights, args.tokenizer], force=args.force)
    outs.add(args.out, TRACE_DIRECTORY)
    cfg = CaptureConfig(hf_config=args.hf_config, prompts=args.prompts, out=args.out,
                        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, weights=args.weights,
                        tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, seed=args.seed,
                        sample=args.sample, ignore_eos=args.ignore_eos, domain=args.domain)
    done = {}
    if not outs.write(args.out, lambda: done.update(r=run_capture(cfg))):
        outs.finish()
    r = done["r"]
    if args.json:
        summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(r).items() if k != "out"}
        print(json.dumps(tagged("capture-summary", {"written": [{"path": str(r.out), "kind": "trace directory"}],
                                                    "warnings": [], "summary": summary}), indent=1))
        return 0
    print(f"wrote {r.out}: {r.num_rows:,} rows ({r.num_requests} requests, {r.num_steps} forward steps, "
          f"{r.num_prompt_tokens:,} prompt tokens, {r.num_generated_tokens:,} generated positions) "
          f"in {r.seconds:.1f} s")
    print(f"excluded: {r.num_padding_tokens:,} padding tokens, {r.num_finished_tokens:,} tokens of finished "
          "requests")
    return 0
