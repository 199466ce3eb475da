"""Random-weight checkpoints of real architectures, for benches on a machine that cannot download
weights (the weights do not change what a step costs; random ones practically never emit EOS, so
each request runs to max_tokens).

    python bench/gpu_models.py OUT_DIR --shape smollm2 --tokenizer bench/wheels/smollm2 [--dtype bfloat16]

shapes: smollm2  SmolLM2-135M's config (read from --tokenizer's config.json), its tokenizer
        llama1b  Llama-3.2-1B's config (16 layers, 2048 hidden, 8 KV heads, 128,256 vocab) with a
                 word-level tokenizer of 128,256 entries made here (Llama's own cannot be carried)
        tiny     2 layers, 64 hidden, SmolLM2's vocabulary and tokenizer: a CPU stand-in for a
                 fast engine, to try the bench itself on a machine without a GPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, bos_token_id=0, eos_token_id=1, pad_token_id=1,
)


def word_level_tokenizer(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>")
    fast.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--shape", choices=["smollm2", "llama1b", "tiny"], required=True)
    parser.add_argument("--tokenizer", help="a folder with SmolLM2's config.json and tokenizer files")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.shape == "llama1b":
        config = LlamaConfig(**LLAMA_1B)
        word_level_tokenizer(config.vocab_size, out)
    else:
        src = Path(args.tokenizer or "")
        if not (src / "tokenizer.json").exists():
            sys.exit(f"--tokenizer {src}: no tokenizer.json there")
        config = AutoConfig.from_pretrained(src)
        if args.shape == "tiny":
            config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16))
        for f in src.iterdir():
            if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json", "generation_config.json"):
                shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"shape": args.shape, "path": str(out), "parameters": params, "dtype": args.dtype}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
