"""What the synthetic engine offers against what it is configured to offer, the engine alone (no
gateway): every stream submitted at once, `--max-tokens` ids each, tok/s counted from the first
output to the last stream's end. The step is `streams / rate` seconds, so a rate above one step per
millisecond needs several steps per timer wake (engines/backends/synthetic.py).

    .venv/bin/python bench/synthetic_pace.py --streams 64,256 --rates 49000,100000,200000,400000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.backends.synthetic import SyntheticCore  # noqa: E402
from gateway.config import default_cache_dir  # noqa: E402


async def offered(streams: int, rate: float, max_tokens: int, tokenizer: str | None) -> float:
    step_ms = streams / rate * 1000.0
    core = SyntheticCore(model_id="pace", step_ms=step_ms, tokens_per_step=1, max_batch_size=streams, context_length=8192,
                         cache_dir=str(default_cache_dir(os.environ)), tokenizer=tokenizer)
    await core.start()
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[float] = loop.create_future()
    first: list[float] = []
    left = [streams]

    def handler(out: object) -> None:
        if not first:
            first.append(loop.time())
        if out.is_finished():  # type: ignore[attr-defined]
            left[0] -= 1
            if not left[0]:
                finished.set_result(loop.time())

    for i in range(streams):
        core.submit(f"r{i}", [1], max_tokens, None, handler)
    end = await finished
    return streams * (max_tokens - 1) / (end - first[0])  # the first step's tokens mark the start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--rates", default="49000,100000,200000,400000", help="configured tok/s, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--tokenizer", help="tokenizer files for the engine (else the embedded model's)")
    args = parser.parse_args()
    for streams in (int(s) for s in args.streams.split(",")):
        for rate in (float(r) for r in args.rates.split(",")):
            got = asyncio.run(offered(streams, rate, args.max_tokens, args.tokenizer))
            print(f"streams {streams:4d}  configured {rate:>9,.0f} tok/s  offered {got:>9,.0f} tok/s  x{got / rate:.3f}", flush=True)


if __name__ == "__main__":
    main()
