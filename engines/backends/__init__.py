"""The engines themselves: hf (in process or its own), trtllm, openai pools, synthetic, embeddings."""
