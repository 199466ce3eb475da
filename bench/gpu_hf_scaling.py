"""GPU throughput of the `hf` engine's continuous batching on a Llama-3.1-8B-shaped model with
dummy bf16 weights (512 input / 256 output tokens), against plain batched `generate` and the
decode roofline (weights + KV bytes per step over the HBM bandwidth). One model, one run.

    python bench/gpu_hf_scaling.py --variants baseline,graphs --concurrency 64,256 --generate 64

Every variant is a ContinuousBatchingConfig (the knobs engines/backends/hf.py exposes); EOS is disabled so
each request generates exactly --output tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

HBM_BYTES_PER_S = 4.3e12  # H200

LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "graphs": {"use_cuda_graph": True},
    "graphs_async": {"use_cuda_graph": True, "use_async_batching": True},
    "big_batch": {"max_batch_tokens": 16384, "max_requests_per_batch": 256},
    "graphs_big_batch": {"use_cuda_graph": True, "max_batch_tokens": 16384, "max_requests_per_batch": 256},
    "graphs_async_big_batch": {"use_cuda_graph": True, "use_async_batching": True, "max_batch_tokens": 16384, "max_requests_per_batch": 256},
    "small_pages": {"page_size": 64},
}


def build_model(attn: str) -> Any:
    config = LlamaConfig(**LLAMA_8B)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    return model.eval()


def roofline_tokens_per_s(model: Any, batch: int, prompt: int, output: int) -> float:
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2
    mean_context = prompt + output / 2
    step_s = (weight_bytes + batch * mean_context * kv_per_token) / HBM_BYTES_PER_S
    return batch / step_s


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n, length), generator=g).tolist()


@torch.inference_mode()
def run_cb(model: Any, variant: dict[str, Any], batch: list[list[int]], output: int) -> dict[str, Any]:
    gen = GenerationConfig(max_new_tokens=output, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**variant))
    manager.start()
    try:
        _drain(manager, prompts(8, 32, model.config.vocab_size, seed=1), 8)  # warm up: graphs, allocator
        torch.cuda.synchronize()
        started = time.perf_counter()
        tokens, ttfts = _drain(manager, batch, output)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    finally:
        manager.stop(block=True, timeout=60)
        model.destroy_cached_continuous_batching_manager()
    return {"tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttfts)}


def _drain(manager: Any, batch: list[list[int]], output: int) -> tuple[int, list[float]]:
    added = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=output) for p in batch]
    pending, tokens, ttfts = set(ids), 0, []
    while pending:
        result = manager.get_result(timeout=1)
        if result is None or result.request_id not in pending:
            continue
        if result.is_finished():
            pending.discard(result.request_id)
            tokens += len(result.generated_tokens)
            if result.lifespan[0] > 0:
                ttfts.append(max(0.0, result.lifespan[0] - added))
    return tokens, ttfts or [0.0]


@torch.inference_mode()
def run_generate(model: Any, batch: list[list[int]], output: int) -> dict[str, Any]:
    ids = torch.tensor(batch, device="cuda")
    kwargs = dict(max_new_tokens=output, min_new_tokens=output, do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ids[:, :32], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm up
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="baseline", help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--generate", default="64", help="batch sizes for plain batched generate ('' to skip)")
    parser.add_argument("--input", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--attn", default="sdpa", help="sdpa or paged|eager")
    parser.add_argument("--json", default="gpu_hf_scaling.json")
    args = parser.parse_args()

    model = build_model(args.attn)
    print(f"torch {torch.__version__}  gpu {torch.cuda.get_device_name()}  attn {args.attn}", flush=True)
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in args.concurrency.split(",") if x]:
        batch = prompts(n, args.input, model.config.vocab_size)
        roof = roofline_tokens_per_s(model, n, args.input, args.output)
        for name in args.variants.split(","):
            r = run_cb(model, VARIANTS[name], batch, args.output)
            rows.append({"mode": f"cb:{name}", "concurrency": n, "roofline_tok_per_s": roof, **r})
            print(json.dumps(rows[-1]), flush=True)
    for n in [int(x) for x in args.generate.split(",") if x]:
        batch = prompts(n, args.input, model.config.vocab_size)
        r = run_generate(model, batch, args.output)
        rows.append({"mode": "generate", "concurrency": n, "roofline_tok_per_s": roofline_tokens_per_s(model, n, args.input, args.output), **r})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'mode':28} {'conc':>5} {'tok/s':>9} {'% roofline':>11} {'wall s':>8}")
    for r in rows:
        print(f"{r['mode']:28} {r['concurrency']:>5} {r['tok_per_s']:>9.0f} {100 * r['tok_per_s'] / r['roofline_tok_per_s']:>10.1f}% {r['wall_s']:>8.1f}")
    with open(args.json, "w") as fh:
        json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
