"""Offline demo: `python -m engine "prompt"` streams a completion from the embedded model."""
from __future__ import annotations

import argparse
import sys

from engine import EngineConfig, LLMEngine, SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    ap.add_argument("prompt")
    ap.add_argument("--model", default=None, help="Hugging Face directory (default: embedded SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.raw:
        engine.add_request("demo", args.prompt, params)
    else:
        engine.add_request("demo", params=params, messages=[{"role": "user", "content": args.prompt}])
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
