"""OpenAI's API: chat and text completions' models, embeddings, the Responses API."""
